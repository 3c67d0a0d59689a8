"""HLO text: parse a module's text into computations and instructions, and print it back.

XLA's own parser (`hlo_module_from_text`) is the reader of what we print; this module only needs
to split instructions into name, shape, opcode, operands and attributes, keep everything else
verbatim, and print lines XLA accepts. Shapes are parsed into `TensorSpec`s for byte counts.
Two readings of a parsed module's structure live here too, for every layer above: the
computations its control flow runs (`control_flow_computations`) and replica groups named by
position (`replica_groups_key`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Iterator

ELEMENTWISE = frozenset(
    """
abs add and atan2 cbrt ceil clamp compare complex convert cos count-leading-zeros divide erf exp
exponential exponential-minus-one floor imag is-finite log log-plus-one logistic maximum minimum
multiply negate not or popcnt power real reduce-precision remainder round-nearest-afz
round-nearest-even rsqrt select shift-left shift-right-arithmetic shift-right-logical sign sin
sqrt subtract tan tanh xor bitcast-convert stochastic-convert
""".split()
)
"""Opcodes computing each output element from the same element of their operands (the backends'
loop fusion holds them; the work counter counts one flop per element)."""

DTYPE_BYTES = {
    "pred": 1,
    "s2": 1,
    "u2": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One array: element type and dimensions (layout dropped)."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


@functools.lru_cache(maxsize=1 << 16)
def parse_shape(text: str) -> tuple[TensorSpec, ...]:
    """All arrays in a (possibly tuple) shape text, flattened in order. `token[]` counts as 0 bytes.
    Cached: cost models and the GNN's features ask for the same shapes on every candidate."""
    text = re.sub(r"/\*.*?\*/", "", text)
    text = re.sub(r"\{[^{}]*\}", "", text)  # layouts
    specs = []
    for m in _ARRAY_RE.finditer(text):
        dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip())
        specs.append(TensorSpec(m.group(1), dims))
    if not specs and text.strip().startswith("token"):
        specs.append(TensorSpec("token", ()))
    return tuple(specs)


# The characters the bracket scanners act on; they jump from one to the next (an HLO line is
# mostly names and attribute values: scanning it a character at a time in Python was a tenth of
# the time of capturing a tiny zoo step).
_SPECIAL_RE = re.compile(r'[(){}\[\]"\\,]')
_OPEN, _CLOSE = "({[", ")}]"


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside (), {}, [] and quotes."""
    special = _SPECIAL_RE if sep == "," else re.compile(r'[(){}\[\]"\\' + re.escape(sep) + "]")
    parts, depth, start, quote, escaped = [], 0, 0, False, -1
    for m in special.finditer(text):
        i = m.start()
        if i == escaped:
            continue
        c = text[i]
        if quote:
            if c == "\\":
                escaped = i + 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at `start` (quotes respected)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, quote, escaped = [], False, -1
    for m in _SPECIAL_RE.finditer(text, start):
        i = m.start()
        if i == escaped:
            continue
        c = text[i]
        if quote:
            if c == "\\":
                escaped = i + 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start : start + 80]!r}")


@dataclasses.dataclass
class Instruction:
    """One HLO instruction. `operands` are names without '%'; `literal` is the raw text in the
    parentheses when they do not hold operands (constant values, parameter numbers)."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    literal: str | None
    attrs: list[tuple[str, str]]
    is_root: bool = False

    def attr(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return parse_shape(self.shape)

    @property
    def output_bytes(self) -> int:
        return sum(s.bytes for s in self.outputs)

    @property
    def called_computations(self) -> list[str]:
        names = []
        for k, v in self.attrs:
            if k in (
                "calls",
                "to_apply",
                "body",
                "condition",
                "true_computation",
                "false_computation",
                "branch_computations",
                "called_computations",
            ):
                names += [n.strip().lstrip("%") for n in v.strip("{}").split(",") if n.strip()]
        return names

    def attrs_text(self, drop_metadata: bool = False) -> str:
        return ", ".join(
            f"{k}={v}" if v is not None else k
            for k, v in self.attrs
            if not (drop_metadata and k in ("metadata", "frontend_attributes"))
        )

    def to_text(self, drop_metadata: bool = False) -> str:
        inner = self.literal if self.literal is not None else ", ".join(f"%{o}" for o in self.operands)
        line = f"{'ROOT ' if self.is_root else ''}%{self.name} = {self.shape} {self.opcode}({inner})"
        attrs = self.attrs_text(drop_metadata)
        return f"  {line}, {attrs}" if attrs else f"  {line}"


def parse_instruction(line: str) -> Instruction:
    text = line.strip()
    is_root = text.startswith("ROOT ")
    if is_root:
        text = text[5:]
    name, _, rest = text.partition(" = ")
    name = name.strip().lstrip("%")
    rest = rest.strip()
    # Shape: a tuple in parentheses or one token.
    if rest.startswith("("):
        end = _matching(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].strip()
    paren = rest.index("(")
    opcode = rest[:paren]
    close = _matching(rest, paren)
    inner, tail = rest[paren + 1 : close - 1], rest[close:].lstrip(", ").strip()
    items = split_top_level(re.sub(r"/\*.*?\*/", "", inner))
    if items and all("%" in item for item in items):
        operands = [item.split()[-1].lstrip("%") for item in items]
        literal = None
    else:
        operands, literal = [], inner
    attrs = []
    for item in split_top_level(tail):
        key, eq, value = item.partition("=")
        attrs.append((key.strip(), value.strip() if eq else None))
    return Instruction(name, shape, opcode, operands, literal, attrs, is_root)


@dataclasses.dataclass
class Computation:
    name: str
    header: str  # the full header line, e.g. '%fused (p: f32[2]) -> f32[2] {'
    instructions: list[Instruction]
    is_entry: bool = False

    @property
    def root(self) -> Instruction:
        for inst in self.instructions:
            if inst.is_root:
                return inst
        return self.instructions[-1]

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    def to_text(self, drop_metadata: bool = False) -> str:
        body = "\n".join(i.to_text(drop_metadata) for i in self.instructions)
        return f"{self.header}\n{body}\n}}"


@dataclasses.dataclass
class HloModuleText:
    """A parsed HLO module: header line, verbatim preamble (stack-frame tables), computations."""

    header: str
    preamble: str
    computations: list[Computation]

    @property
    def name(self) -> str:
        return self.header.split()[1].rstrip(",")

    @property
    def entry(self) -> Computation:
        for c in self.computations:
            if c.is_entry:
                return c
        raise ValueError("HLO module has no ENTRY computation")

    def computation(self, name: str) -> Computation:
        for c in self.computations:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_text(self, drop_metadata: bool = False) -> str:
        comps = "\n\n".join(c.to_text(drop_metadata) for c in self.computations)
        preamble = "" if drop_metadata else self.preamble
        return f"{self.header}\n\n{preamble}{comps}\n"


def replica_groups_key(text: str | None) -> str | None:
    """Replica groups with mesh axis names replaced by their positions: XLA (jax 0.12) prints
    `mesh['data'=8] {'data'}` for one all-reduce and `mesh['axis_0'=8] {'axis_0'}` for another
    over the same devices, and combines them; so may we."""
    m = re.fullmatch(r"mesh\[(.*)\]\s*\{(.*)\}", text or "")
    if m is None:
        return text
    axes = [a.strip() for a in m.group(1).split(",") if a.strip()]
    names = [a.split("=")[0].strip() for a in axes]
    reduced = [r.strip() for r in m.group(2).split(",") if r.strip()]
    if any(r not in names for r in reduced):
        return text
    sizes = ",".join(a.split("=", 1)[1].strip() if "=" in a else a for a in axes)
    return f"mesh[{sizes}] {{{','.join(str(names.index(r)) for r in reduced)}}}"


CONTROL_FLOW = frozenset({"while", "conditional", "call"})


def control_flow_computations(module: HloModuleText) -> list[Computation]:
    """The computations the entry's control flow runs (`while` bodies and conditions,
    `conditional` branches, `call`ed computations), nested ones too, each once, in the order met."""
    found: dict[str, Computation] = {}
    stack = [module.entry]
    while stack:
        for inst in stack.pop(0).instructions:
            if inst.opcode in CONTROL_FLOW:
                for name in inst.called_computations:
                    if name not in found:
                        found[name] = module.computation(name)
                        stack.append(found[name])
    return list(found.values())


_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")


def _logical_lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line.strip():
            yield line


def parse_module(text: str) -> HloModuleText:
    """Parse `HloModule.to_string()` output."""
    lines = list(_logical_lines(text))
    if not lines or not lines[0].startswith("HloModule"):
        raise ValueError("not HLO module text (expected a first line 'HloModule ...')")
    header = lines[0]
    preamble_lines: list[str] = []
    computations: list[Computation] = []
    current: Computation | None = None
    for line in lines[1:]:
        if current is None:
            m = _COMP_RE.match(line)
            if m and not line.startswith(" "):
                current = Computation(m.group(2), line, [], is_entry=bool(m.group(1)))
            else:
                preamble_lines.append(line)
        elif line.strip() == "}":
            computations.append(current)
            current = None
        else:
            current.instructions.append(parse_instruction(line))
    if current is not None:
        raise ValueError(f"computation {current.name} is not closed")
    preamble = "\n".join(preamble_lines) + "\n\n" if preamble_lines else ""
    return HloModuleText(header, preamble, computations)


def fingerprint(text: str) -> str:
    """Identity of a module that ignores metadata, stack frames and the module's id suffixes.

    Two compiles of the same program on the same backend give the same fingerprint; any change
    in shapes, ops or their wiring changes it."""
    return module_fingerprint(parse_module(text))


def module_fingerprint(module: HloModuleText) -> str:
    """`fingerprint` of a module already parsed (`build_graph` parses once for both)."""
    canonical = module.to_text(drop_metadata=True)
    canonical = re.sub(r", entry_computation_layout=\{.*?\}(?=,|$)", "", canonical, count=1)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def loop_body_allreduces(module: HloModuleText) -> tuple[tuple[str, str], ...]:
    """The all-reduces of several tensors of one element type inside the bodies of the module's
    `while` loops (nested loops too), as (body computation, all-reduce) names."""
    bodies = {
        i.attr("body", "").lstrip("%") for c in module.computations for i in c.instructions if i.opcode == "while"
    }
    found = []
    for comp in control_flow_computations(module):
        if comp.name not in bodies:
            continue
        for inst in comp.instructions:
            if inst.opcode == "all-reduce" and len(inst.operands) > 1 and len({t.dtype for t in inst.outputs}) == 1:
                found.append((comp.name, inst.name))
    return tuple(found)
