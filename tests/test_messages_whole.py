"""Error and log messages are written whole in the source, so a user can grep for what they saw.

The rule: a message is one string literal or one f-string per sentence. Python joins adjacent
literals (``"a " "b"``) into one string, and a formatter that wraps long lines leaves a sentence
cut into fragments such as ``"(node "`` / ``"of "``; no fragment then holds what the user read.

The checker reads every product module (server, client, backend, smddp, compat; not the tests,
not the generated protos) with ``tokenize`` and looks at each run of adjacent string tokens
(comments and line breaks between them allowed). On Python 3.11 an f-string is one STRING token,
so a run may mix plain strings and f-strings. A boundary between two fragments is whole when the
earlier fragment ends a sentence or a clause: with ``. ``, ``: ``, ``; ``, ``? `` or ``! `` (the
punctuation, then the space that would start the next one), or with a newline escape. ``e.g. `` and
``i.e. `` end no sentence, and neither do ``), `` or a bare space: such a boundary cuts a sentence.
Nor may a boundary fall inside a parenthesis the fragments before it opened (``"(0: "`` then
``"any free port)"``): the parenthesis is part of its sentence. The next fragment may start in
lower case (``"...: "`` then ``"rank 3 ..."``, or a clause after ``; ``). A sentence too long
for 100 columns is built from named parts, or left on one line with ``# noqa: E501``.

``server/gpu_kernels.py`` is not read: its adjacent literals are lines of CUDA C source for NVRTC,
not messages.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("server", "client", "backend", "core", "compat")
# CUDA C source, not messages (see the module docstring).
NOT_MESSAGES = {Path("server/gpu_kernels.py")}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")

_PREFIX = re.compile(r"(?i)([rbfu]*)('''|\"\"\"|'|\")")
# What a fragment may end with when the next fragment starts a new sentence or clause.
_WHOLE_END = re.compile(r"([.:;?!] |\\n)$")
_NOT_AN_END = re.compile(r"(^|\W)(e\.g\.|i\.e\.) $")


def _body(token: str) -> str:
    """The text between a string token's quotes (prefix and quotes dropped, escapes kept)."""
    m = _PREFIX.match(token)
    assert m is not None, token
    return token[m.end() : len(token) - len(m.group(2))]


def _open_parentheses(text: str) -> int:
    """How many parentheses ``text`` leaves open, outside f-string replacement fields."""
    depth = fields = i = 0
    while i < len(text):
        if fields == 0 and text[i : i + 2] in ("{{", "}}"):
            i += 2
            continue
        c = text[i]
        if c == "{":
            fields += 1
        elif c == "}":
            fields -= 1
        elif fields == 0 and c in "()":
            depth += 1 if c == "(" else -1
        i += 1
    return depth


def cut_sentences(source: str) -> list[tuple[int, str, str]]:
    """Where ``source`` joins adjacent string literals inside a sentence.

    Returns:
        One ``(line, end of the earlier fragment, start of the next)`` per boundary that cuts a
        sentence, in source order.
    """
    found: list[tuple[int, str, str]] = []
    run: list[tokenize.TokenInfo] = []

    def close() -> None:
        before = ""
        for a, b in zip(run, run[1:]):
            end = _body(a.string)
            # A plain string's braces are text: written as an f-string would write them.
            plain = "f" not in a.string[: a.string.index(a.string[-1])].lower()
            before += end.replace("{", "{{").replace("}", "}}") if plain else end
            if (
                not _WHOLE_END.search(end)
                or _NOT_AN_END.search(end)
                or _open_parentheses(before) > 0
            ):
                found.append((a.start[0], end[-30:], _body(b.string)[:30]))
        run.clear()

    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            run.append(tok)
        elif tok.type in (tokenize.NL, tokenize.COMMENT) and run:
            continue
        else:
            close()
    close()
    return found


def product_modules() -> list[Path]:
    """Every product module's path, relative to the repository's root."""
    paths = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if GENERATED.search(path.name) or rel in NOT_MESSAGES:
                continue
            paths.append(rel)
    return paths


def test_the_checker_finds_a_cut_sentence() -> None:
    cut = 'raise E(\n    f"{a} (node "\n    f"{b}) called {c} as op #{d}"\n)\n'
    assert cut_sentences(cut) == [(2, "{a} (node ", "{b}) called {c} as op #{d}")]
    # A plain word boundary, a ", " and an "e.g. " all cut a sentence.
    assert len(cut_sentences('x = ("holds 4 elements " "of this chunk")\n')) == 1
    assert len(cut_sentences('x = ("first, " "second")\n')) == 1
    assert len(cut_sentences('x = ("install it (e.g. " "pip install x)")\n')) == 1
    # A clause end inside an open parenthesis cuts it; "{{" and a field's "(" do not count.
    assert len(cut_sentences('x = ("a port (0: " "any free port)")\n')) == 1
    assert cut_sentences('x = (f"{f(a)}: " "b")\n') == []
    assert cut_sentences('x = (f"a {{(: " "b")\n') == [(1, "a {{(: ", "b")]
    assert cut_sentences('x = ("a {(: " "b")\n') == [(1, "a {(: ", "b")]


def test_the_checker_passes_whole_sentences_and_clauses() -> None:
    whole = (
        'x = (\n    f"{who}: "  # the prefix\n    "rank 3 called all_reduce; "\n'
        '    "the others waited. "\n    "Start it again? "\n    "Yes!"\n)\n'
        'y = "one literal"\nz = ("line one\\n" "line two")\n'
    )
    assert cut_sentences(whole) == []


def test_there_are_product_modules_to_read() -> None:
    modules = product_modules()
    assert Path("server/registry.py") in modules and Path("client/communicator.py") in modules
    assert not any(GENERATED.search(p.name) for p in modules)


@pytest.mark.timeout(120)
def test_no_message_in_product_code_is_cut_into_fragments() -> None:
    cuts = [
        f"{path}:{line}: {end!r} | {start!r}"
        for path in product_modules()
        for line, end, start in cut_sentences((ROOT / path).read_text())
    ]
    assert cuts == [], "sentences cut into adjacent literals:\n" + "\n".join(cuts)


# Messages a user sees, as the source writes them: each must be found whole in its module.
KNOWN = [
    (
        "server/hierarchical.py",
        "called {theirs} as op #{self.req0.seq} while {ours} called {mine}",
    ),
    (
        "server/hierarchical.py",
        "holds {a.size} elements of this chunk where {n} were expected",
    ),
    (
        "server/registry.py",
        "rank {req.rank} describes the job's nodes differently than the ranks registered before it",
    ),
    (
        "server/registry.py",
        "is smaller than 4 x the communicator's chunk of",
    ),
    ("server/ctl.py", "a smddpd that stopped without removing it; "),
    ("client/communicator.py", "the communicator has been destroyed (destroy_process_group); "),
]


@pytest.mark.parametrize(("module", "text"), KNOWN)
def test_a_known_message_is_found_whole_in_its_module(module: str, text: str) -> None:
    assert text in (ROOT / module).read_text(), f"{text!r} is not written whole in {module}"
