"""Reading a compiled module's entry computation in tests, without the library's parser: what
the compiled-program model must agree with."""

import re

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}


def entry_instructions(text: str) -> list[tuple[str, str]]:
    """(name, opcode) of every instruction of the ENTRY computation, read from the text here
    without the library's parser: the shape after ' = ' is a tuple in parentheses or one token."""
    return [(name, opcode) for name, opcode, _ in computation_instructions(text)]


def computation_instructions(text: str, name: str | None = None) -> list[tuple[str, str, str]]:
    """(name, opcode, line) of every instruction of computation `name` (default: the ENTRY)."""
    lines = text.splitlines()
    if name is None:
        start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    else:
        start = next(i for i, line in enumerate(lines) if line.startswith((f"%{name} ", f"{name} ")))
    found = []
    for line in lines[start + 1 :]:
        if line.strip() == "}":
            break
        name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
        if rest.startswith("("):
            depth, end = 0, 0
            while end == 0 or depth:
                depth += {"(": 1, ")": -1}.get(rest[end], 0)
                end += 1
            rest = rest[end:]
        else:
            rest = rest.split(" ", 1)[1]
        found.append((name.lstrip("%"), rest.strip().split("(", 1)[0], line))
    return found


def module_kernels(text: str) -> tuple[int, list[tuple[str, str]]]:
    """The module's compute kernels (every entry instruction that is not free, not a collective
    and not the done half of an async pair) and its collectives (name, opcode), counted here."""
    compute, collectives = 0, []
    for name, opcode in entry_instructions(text):
        if opcode in FREE or opcode.endswith("-done"):
            continue
        if opcode.removesuffix("-start") in COLLECTIVES or opcode == "async-start":
            collectives.append((name, opcode))
        else:
            compute += 1
    return compute, collectives


def executed_kernels(text: str, computation: str | None = None) -> tuple[int, int]:
    """(compute kernel runs, collective runs) per step of a computation (default: the ENTRY),
    counted here: as `module_kernels` does, where a `while` with XLA's `known_trip_count` counts
    its body's kernels that many times (a `fusion-start` is a compute kernel; no condition: the
    runtime runs a known trip count as a for loop)."""
    compute = collectives = 0
    for _, opcode, line in computation_instructions(text, computation):
        if opcode == "while":
            trips = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
            body_compute, body_collectives = executed_kernels(text, re.search(r"body=%?([\w.\-]+)", line).group(1))
            compute, collectives = compute + trips * body_compute, collectives + trips * body_collectives
        elif opcode in FREE or opcode.endswith("-done"):
            continue
        elif opcode.removesuffix("-start") in COLLECTIVES or opcode == "async-start":
            collectives += 1
        else:
            compute += 1
    return compute, collectives
