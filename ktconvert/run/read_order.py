"""In which order ``runner.run_jobs`` reads the source: groups of files, each group's matrices merged in name order.

An output's file hash follows its pieces as they are written (``formats.ordered_hash``) as long as they go out in
the file's order. A GPU shard holds one layer's experts sorted by name (expert 0, 1, 10, 100, ..., 11, ...), but a
hub checkpoint stores a layer's experts in several files by number (0-27 in one, 28-55 in the next, ...), each
file sorted by name inside. Read file after file, expert 100 would come long after expert 11 was written: every
piece after it parked or read back. So the files holding the same layers form a group, read by one thread with
every file of the group open, each front to back with its own sha256 stream, the next matrix always the one
whose tensor name comes first among the files' next ones: a merge of sorted lists, which is the output's order.

A group is capped at ``MAX_GROUP_FILES`` files (a hub checkpoint whose every file boundary splits a layer is
otherwise one group): a layer split between two capped groups is the only one whose pieces may arrive out of
order. Several groups are read at once by several threads. Nothing here changes a byte, only the reading order.
"""
from __future__ import annotations

import heapq
from collections import defaultdict

MAX_GROUP_FILES = 8   # files one reading thread holds open at once


def read_groups(files: list, layers_of: dict, max_files: int | None = None) -> list[list]:
    """`files` (in the source's order) grouped: files sharing a layer are in one group, groups in the order of
    their first file, each group's files in source order, split into runs of at most `max_files`
    (None: MAX_GROUP_FILES).

    layers_of: {file: layers whose matrices it holds} (files without jobs may be absent)."""
    max_files = max_files or MAX_GROUP_FILES
    parent = list(range(len(files)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_with: dict = {}
    for i, f in enumerate(files):
        for layer in layers_of.get(f, ()):
            j = first_with.setdefault(layer, i)
            parent[root(i)] = root(j)
    members = defaultdict(list)
    for i in range(len(files)):
        members[root(i)].append(i)
    groups = []
    for indexes in sorted(members.values()):
        for start in range(0, len(indexes), max_files):
            groups.append([files[i] for i in indexes[start:start + max_files]])
    return groups


def merged_jobs(per_file: list[list]) -> list:
    """The jobs of several files (each list in offset order) as one list: at each step the job whose tensor name
    (then offset) is smallest among the files' next jobs, so every file is still read front to back."""
    return list(heapq.merge(*per_file, key=_name_order))


def _name_order(job) -> tuple[str, int]:
    return (job.tensor, job.offset)
