"""A rank family: the traces FILE.rank{r}.json.gz that `memplan trace --nproc N` writes for FILE.json.gz, read in one
place for every command that shows ranks side by side (run, fit, compare, plot).

A rank trace's meta has `rank`, `world_size` and, where one trace stands for several ranks alike by construction,
`ranks` (the ranks it stands for; no file is written for the others). A family is complete when every rank of the
world is stood for by exactly one file and every file names the same world size; anything else is one
RankFamilyError line naming the file or rank at fault.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import MemplanError
from memplan.traces.format import Trace, load

SUFFIXES = (".json.gz", ".json")


class RankFamilyError(MemplanError):
    """Rank traces that do not make one world: a rank no file stands for, or world sizes that disagree."""


@dataclass(frozen=True)
class RankTrace:
    """One file of a rank family: the ranks its trace stands for (the first is its own) and the world's size."""

    path: Path
    ranks: tuple[int, ...]
    world_size: int
    trace: Trace

    @property
    def label(self) -> str:
        """`rank 0`, `ranks 1-3` or `ranks 0, 2`: the ranks this trace stands for, in words."""
        return ranks_label(self.ranks)


def rank_path(output: str | os.PathLike, rank: int) -> Path:
    """FILE.json.gz -> FILE.rank{r}.json.gz (also for .json; any other name gets .rank{r} appended)."""
    path = Path(output)
    for suffix in SUFFIXES:
        if path.name.endswith(suffix):
            return path.with_name(f"{path.name[: -len(suffix)]}.rank{rank}{suffix}")
    return path.with_name(f"{path.name}.rank{rank}")


def stands_for(meta: dict) -> tuple[int, ...]:
    """The ranks a trace stands for: its meta's `ranks`, else its own `rank`; () for a trace of no rank."""
    if meta.get("rank") is None:
        return ()
    return tuple(int(r) for r in meta.get("ranks", [meta["rank"]]))


def ranks_label(ranks: tuple[int, ...] | list[int]) -> str:
    """The ranks in words: `rank 0`, `ranks 1-3` (consecutive), `ranks 0, 2, 5`."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _split(name: str) -> tuple[str, int] | None:
    """FILE.rank{r}.json.gz -> (FILE.json.gz, r); None for a name that is not a rank file's."""
    for suffix in SUFFIXES:
        m = re.fullmatch(rf"(.*)\.rank(\d+){re.escape(suffix)}", name)
        if m:
            return m.group(1) + suffix, int(m.group(2))
    m = re.fullmatch(r"(.*)\.rank(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else None


def family_paths(base: str | os.PathLike) -> list[Path]:
    """The files FILE.rank*.json.gz of FILE.json.gz on disk, by rank; [] when there are none."""
    base = Path(base)
    found = []
    folder = base.parent if str(base.parent) else Path(".")
    if folder.is_dir():
        for path in folder.iterdir():
            split = _split(path.name)
            if split is not None and split[0] == base.name and path.is_file():
                found.append((split[1], path))
    return [path for _, path in sorted(found)]


def remove_stale(written: list[Path]) -> list[Path]:
    """Remove the files of the rank families in `written` that it does not hold (an earlier run's ranks: a larger
    world, or ranks traced one by one that are now stood for by one trace), so they never join the new family;
    returns those removed."""
    kept: dict[Path, set[Path]] = {}
    for path in written:
        split = _split(path.name)
        if split is not None:
            kept.setdefault(path.with_name(split[0]), set()).add(path)
    stale = [path for base, paths in kept.items() for path in family_paths(base) if path not in paths]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _rank_trace(path: Path, trace: Trace) -> RankTrace:
    meta = trace.meta
    if meta.get("rank") is None or meta.get("world_size") is None:
        raise RankFamilyError(f"{path}: not a rank trace (its meta has no rank and world_size)")
    split = _split(path.name)
    if split is not None and split[1] != int(meta["rank"]):
        raise RankFamilyError(f"{path}: holds rank {meta['rank']}'s trace, not rank {split[1]}'s")
    return RankTrace(path, stands_for(meta), int(meta["world_size"]), trace)


def check_world(base: str | os.PathLike, members: list[RankTrace], *, complete: bool) -> None:
    """RankFamilyError unless the members name one world size, no rank twice and (when `complete`) every rank of
    it: the one check of a family, whether read from disk or listed by hand."""
    sizes = {m.world_size for m in members}
    if len(sizes) > 1:
        seen = ", ".join(f"{m.path.name}: {m.world_size}" for m in members)
        raise RankFamilyError(f"{base}: the rank traces' world sizes disagree ({seen})")
    world = sizes.pop()
    owner: dict[int, Path] = {}
    for m in members:
        for r in m.ranks:
            if not 0 <= r < world:
                raise RankFamilyError(f"{m.path}: stands for rank {r}, outside its world of {world}")
            if r in owner:
                raise RankFamilyError(f"{base}: rank {r} is stood for by both {owner[r].name} and {m.path.name}")
            owner[r] = m.path
    missing = [r for r in range(world) if r not in owner]
    if complete and missing:
        raise RankFamilyError(
            f"{rank_path(base, missing[0])}: missing (rank {missing[0]} of {world}; no rank trace stands for it)"
        )


def load_family(base: str | os.PathLike) -> list[RankTrace]:
    """Read FILE.json.gz's rank family from disk, one RankTrace per distinct trace in rank order; RankFamilyError when
    there is none, a rank is missing, or the world sizes disagree."""
    paths = family_paths(base)
    if not paths:
        raise RankFamilyError(f"{base}: no such trace, and no rank traces {rank_path(base, 0).name} ...")
    members = sorted((_rank_trace(p, load(p)) for p in paths), key=lambda m: m.ranks[0])
    check_world(base, members, complete=True)
    return members


def traces_by_rank(base: str | os.PathLike) -> list[Trace]:
    """Every rank's trace of FILE.json.gz's family in rank order: a trace that stands for several ranks is each of
    theirs (load_family's checks first)."""
    by_rank = {r: member.trace for member in load_family(base) for r in member.ranks}
    return [by_rank[r] for r in sorted(by_rank)]


def load_traces(files: list[str] | tuple[str, ...]) -> list[tuple[str, Trace]]:
    """The traces of a multi-trace command, named by file, in the order given: a name that is no file but has rank
    traces stands for its whole family; rank files listed by hand may be a few of a world, but those of one family
    must agree on its size (no rank twice)."""
    named: list[tuple[str, Trace]] = []
    for name in files:
        if not Path(name).exists() and family_paths(name):
            named += [(str(m.path), m.trace) for m in load_family(name)]
        else:
            named.append((name, load(name)))
    families: dict[str, dict[Path, RankTrace]] = {}
    for name, trace in named:
        split = _split(Path(name).name)
        if split is not None and trace.meta.get("rank") is not None:  # a file named twice is one member
            family = families.setdefault(str(Path(name).with_name(split[0])), {})
            family[Path(name).resolve()] = _rank_trace(Path(name), trace)
    for base, members in families.items():
        check_world(base, list(members.values()), complete=False)
    return named
