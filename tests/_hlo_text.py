"""Reading a compiled module's entry computation in tests, without the library's parser: what
the compiled-program model must agree with."""

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}


def entry_instructions(text: str) -> list[tuple[str, str]]:
    """(name, opcode) of every instruction of the ENTRY computation, read from the text here
    without the library's parser: the shape after ' = ' is a tuple in parentheses or one token."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
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
        found.append((name.lstrip("%"), rest.strip().split("(", 1)[0]))
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
