"""A small interpreter of the C the GPU kernel generator writes, on numpy arrays.

``server/gpu_kernels.py`` writes each dtype's conversions and combine step as one-line C
functions and the kernels' per-element bodies as a few statements. This module evaluates
exactly that text with C's rules (integer promotion, the usual arithmetic conversions,
unsigned wrap-around, comparisons and logic giving int 0/1, casts), element-wise over numpy
arrays, so tests can compare the generated code with the host path on machines without a
GPU. The float16/bfloat16 helpers of the preamble (PTX and bit tricks) are given their
defined meaning here (round to nearest even, as numpy and ml_dtypes do).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

CTYPES: dict[str, np.dtype] = {
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
    "int": np.dtype(np.int32),
    "unsigned int": np.dtype(np.uint32),
    "long long": np.dtype(np.int64),
    "unsigned long long": np.dtype(np.uint64),
    "signed char": np.dtype(np.int8),
    "unsigned char": np.dtype(np.uint8),
    "short": np.dtype(np.int16),
    "unsigned short": np.dtype(np.uint16),
}
_TYPE_WORDS = {"unsigned", "signed", "char", "short", "int", "long", "float", "double"}
_RANK = {
    np.dtype(np.int32): 1,
    np.dtype(np.uint32): 1,
    np.dtype(np.int64): 2,
    np.dtype(np.uint64): 2,
}


def promote(dt: np.dtype) -> np.dtype:
    """C integer promotion: anything narrower than int becomes int."""
    if dt.kind in "biu" and dt.itemsize < 4:
        return np.dtype(np.int32)
    return dt


def common(a: np.dtype, b: np.dtype) -> np.dtype:
    """C's usual arithmetic conversions for the types above."""
    a, b = promote(a), promote(b)
    if np.dtype(np.float64) in (a, b):
        return np.dtype(np.float64)
    if np.dtype(np.float32) in (a, b):
        return np.dtype(np.float32)
    if a == b:
        return a
    if a.kind == b.kind:
        return a if _RANK[a] > _RANK[b] else b
    signed, unsigned = (a, b) if a.kind == "i" else (b, a)
    if _RANK[unsigned] >= _RANK[signed]:
        return unsigned
    if signed.itemsize > unsigned.itemsize:
        return signed
    return np.dtype(f"u{signed.itemsize}")


def convert(value: np.ndarray, dt: np.dtype) -> np.ndarray:
    """C conversion to ``dt`` (integers wrap; the values here never need float->int)."""
    if value.dtype == dt:
        return value
    with np.errstate(all="ignore"):
        if value.dtype.kind == "f" and dt.kind in "iu":
            raise AssertionError("float to integer conversion does not occur in the kernels")
        return value.astype(dt)


def _h2f(x: np.ndarray) -> np.ndarray:
    return convert(x, np.dtype(np.uint16)).view(np.float16).astype(np.float32)


def _f2h(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is the defined result
        return convert(x, np.dtype(np.float32)).astype(np.float16).view(np.uint16)


def _bf2f(x: np.ndarray) -> np.ndarray:
    return (convert(x, np.dtype(np.uint16)).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f2bf(x: np.ndarray) -> np.ndarray:
    return convert(x, np.dtype(np.float32)).astype(ml_dtypes.bfloat16).view(np.uint16)


BUILTINS = {"h2f": _h2f, "f2h": _f2h, "bf2f": _bf2f, "f2bf": _f2bf}

# -- parsing ------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"\s*(0[xX][0-9a-fA-F]+[uU]?|\d+[uU]?|[A-Za-z_]\w*|\|\||&&|==|!=|<=|>=|[-+*/&|^<>!?:(),])"
)
_BINARY = {
    "||": 1,
    "&&": 2,
    "|": 3,
    "^": 4,
    "&": 5,
    "==": 6,
    "!=": 6,
    "<": 7,
    "<=": 7,
    ">": 7,
    ">=": 7,
    "+": 8,
    "-": 8,
    "*": 9,
    "/": 9,
}


def tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise SyntaxError(f"cannot read C at {text[pos:]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


@dataclass
class Parser:
    """Pratt parser of one expression into nested tuples."""

    tokens: list[str]
    typedefs: dict[str, str] = field(default_factory=dict)
    pos: int = 0

    def peek(self, k: int = 0) -> str | None:
        i = self.pos + k
        return self.tokens[i] if i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise SyntaxError(f"expected {expected!r}, found {tok!r} in {' '.join(self.tokens)}")
        self.pos += 1
        return tok

    def parse(self) -> tuple:
        tree = self.ternary()
        if self.peek() is not None:
            raise SyntaxError(f"trailing tokens {self.tokens[self.pos :]}")
        return tree

    def ternary(self) -> tuple:
        cond = self.binary(0)
        if self.peek() == "?":
            self.take("?")
            yes = self.ternary()
            self.take(":")
            no = self.ternary()
            return ("?:", cond, yes, no)
        return cond

    def binary(self, min_prec: int) -> tuple:
        left = self.unary()
        while True:
            op = self.peek()
            prec = _BINARY.get(op or "")
            if prec is None or prec <= min_prec:
                return left
            self.take()
            right = self.binary(prec)
            left = ("bin", op, left, right)

    def _type_at(self) -> str | None:
        """The type name of a cast starting at '(' here, or None."""
        words, k = [], 1
        while (tok := self.peek(k)) is not None and (tok in _TYPE_WORDS or tok in self.typedefs):
            words.append(tok)
            k += 1
        if words and self.peek(k) == ")":
            return " ".join(words)
        return None

    def unary(self) -> tuple:
        tok = self.peek()
        if tok in ("!", "-"):
            self.take()
            return ("un", tok, self.unary())
        if tok == "(":
            ctype = self._type_at()
            if ctype is not None:
                for _ in range(len(ctype.split()) + 2):
                    self.take()
                return ("cast", self.typedefs.get(ctype, ctype), self.unary())
            self.take("(")
            inner = self.ternary()
            self.take(")")
            return inner
        return self.postfix()

    def postfix(self) -> tuple:
        tok = self.take()
        if re.fullmatch(r"0[xX][0-9a-fA-F]+[uU]?|\d+[uU]?", tok):
            unsigned = tok[-1] in "uU"
            return ("num", int(tok.rstrip("uU"), 0), "unsigned int" if unsigned else "int")
        if self.peek() == "(":
            self.take("(")
            args = []
            if self.peek() != ")":
                args.append(self.ternary())
                while self.peek() == ",":
                    self.take(",")
                    args.append(self.ternary())
            self.take(")")
            return ("call", tok, args)
        return ("var", tok)


# -- evaluating ---------------------------------------------------------------------------------


@dataclass
class Function:
    """A one-line ``ret name(params) { return expr; }`` of the generated source."""

    ret: str
    params: list[tuple[str, str]]
    body: tuple


@dataclass
class Program:
    """The typedefs and one-line functions of a generated module."""

    typedefs: dict[str, str]
    functions: dict[str, Function]

    def ctype(self, name: str) -> np.dtype:
        return CTYPES[self.typedefs.get(name, name)]

    def parse(self, text: str) -> tuple:
        return Parser(tokenize(text), self.typedefs).parse()

    def eval(self, tree: tuple, env: dict[str, np.ndarray]) -> np.ndarray:
        kind = tree[0]
        if kind == "num":
            return np.asarray(tree[1], dtype=CTYPES[tree[2]])
        if kind == "var":
            return env[tree[1]]
        if kind == "cast":
            return convert(self.eval(tree[2], env), CTYPES[tree[1]])
        if kind == "un":
            x = self.eval(tree[2], env)
            if tree[1] == "!":
                return (x == 0).astype(np.int32)
            x = convert(x, promote(x.dtype))
            with np.errstate(all="ignore"):
                return np.negative(x)
        if kind == "?:":
            cond = self.eval(tree[1], env)
            yes, no = self.eval(tree[2], env), self.eval(tree[3], env)
            dt = common(yes.dtype, no.dtype)
            return np.where(cond != 0, convert(yes, dt), convert(no, dt))
        if kind == "call":
            args = [self.eval(a, env) for a in tree[2]]
            if tree[1] in BUILTINS:
                return BUILTINS[tree[1]](*args)
            fn = self.functions[tree[1]]
            local = {name: convert(a, self.ctype(t)) for (t, name), a in zip(fn.params, args)}
            return convert(self.eval(fn.body, local), self.ctype(fn.ret))
        if kind == "bin":
            op = tree[1]
            a, b = self.eval(tree[2], env), self.eval(tree[3], env)
            if op in ("&&", "||"):
                av, bv = a != 0, b != 0
                return (av & bv if op == "&&" else av | bv).astype(np.int32)
            dt = common(a.dtype, b.dtype)
            a, b = convert(a, dt), convert(b, dt)
            with np.errstate(all="ignore"):
                if op in ("==", "!=", "<", "<=", ">", ">="):
                    fn = {
                        "==": np.equal,
                        "!=": np.not_equal,
                        "<": np.less,
                        "<=": np.less_equal,
                        ">": np.greater,
                        ">=": np.greater_equal,
                    }[op]
                    return fn(a, b).astype(np.int32)
                if op == "/" and dt.kind in "iu":
                    raise AssertionError("integer division does not occur in the kernels")
                fn = {
                    "+": np.add,
                    "-": np.subtract,
                    "*": np.multiply,
                    "/": np.divide,
                    "&": np.bitwise_and,
                    "|": np.bitwise_or,
                    "^": np.bitwise_xor,
                }[op]
                return fn(a, b).astype(dt)
        raise AssertionError(f"unknown node {tree}")


_TYPEDEF = re.compile(r"^typedef (.+?) (\w+);$", re.M)
_FUNCTION = re.compile(
    r"^__device__ __forceinline__ (\w+) (\w+)\(([^)]*)\) \{ return (.*); \}$", re.M
)


def load_program(source: str) -> Program:
    """The typedefs and one-line functions of a generated module."""
    typedefs = {name: ctype for ctype, name in _TYPEDEF.findall(source)}
    program = Program(typedefs, {})
    for ret, name, params, body in _FUNCTION.findall(source):
        plist = []
        for p in params.split(","):
            words = p.split()
            plist.append((" ".join(words[:-1]), words[-1]))
        program.functions[name] = Function(ret, plist, program.parse(body))
    return program


def kernel_bodies(source: str) -> dict[str, list[str]]:
    """Each kernel's per-element statements, by kernel name, with accesses rewritten to
    plain names: input ``in3`` (the element or vector lane of rank 3), output ``outN``,
    result ``r``. Loop, block, pass-barrier and vector load/store lines are dropped."""
    bodies: dict[str, list[str]] = {}
    for m in re.finditer(
        r'extern "C" __global__ void (\w+)\(([^)]*)\) \{\n(.*?)\n\}', source, re.S
    ):
        lines = []
        for line in m.group(3).splitlines():
            line = line.strip()
            if line.startswith(
                (
                    "for ",
                    "const unsigned long long stride",
                    "#pragma",
                    "{",
                    "}",
                    "T r;",
                    "Vec r;",
                    "asm volatile",
                )
            ):
                continue
            if re.fullmatch(r"const Vec v\d+ = \(\(const Vec\*\)in\d+\)\[i\];", line):
                continue
            line = re.sub(r"\(\(const T\*\)in(\d+)\)\[i\]", r"in\1", line)
            line = re.sub(r"v(\d+)\.e\[k\]", r"in\1", line)
            line = re.sub(r"\(\(T\*\)out(\d+)\)\[i\] = r;", r"out\1 = r;", line)
            line = re.sub(r"\(\(Vec\*\)out(\d+)\)\[i\] = r;", r"out\1 = r;", line)
            line = line.replace("r.e[k]", "r")
            lines.append(line)
        bodies[m.group(1)] = lines
    return bodies


def run_body(program: Program, lines: list[str], inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Executes a kernel body (from ``kernel_bodies``) over whole arrays.

    ``inputs`` are in the storage type ``T``. Returns every output ``outN`` (storage type).
    """
    env: dict[str, np.ndarray] = {f"in{r}": x for r, x in enumerate(inputs)}
    declared = {"acc": program.ctype("C"), "r": program.ctype("T")}
    outputs = {}
    for line in lines:
        m = re.fullmatch(r"(?:(\w+) )?(\w+) = (.*);", line)
        if not m:
            raise SyntaxError(f"unexpected kernel statement {line!r}")
        ctype, name, expr = m.groups()
        value = program.eval(program.parse(expr), env)
        if name.startswith("out"):
            outputs[name] = convert(value, program.ctype("T"))
            continue
        target = program.ctype(ctype) if ctype else declared[name]
        env[name] = convert(value, target)
    return outputs
