"""memplan inside other training frameworks: a HuggingFace Trainer callback and an Accelerate loop's step
(integrations/huggingface.py), each recording one optimizer step as `memplan.record` records it."""
