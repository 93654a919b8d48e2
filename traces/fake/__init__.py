"""Fake tensors for a capture: FakeTensorMode with memplan's additions, its dispatch cache, the values a fake
step knows."""
