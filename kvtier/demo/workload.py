"""The replayed workload: multi-turn agent sessions, as text with token budgets.

An agent session is what a context tier is for: every turn re-sends the whole
conversation — a long system prompt shared by all users (instructions and tool
schemas), then user messages, tool outputs (file reads, test logs, grep hits)
and the assistant's replies — and appends a little to it. Without a context
tier each turn recomputes everything; with one, only what was appended.

Texts are deterministic (seeded, built from the Python standard library's own
sources, which are on every machine); the worker tokenizes each message and
cuts it to its token budget, so a scenario's sizes are in tokens. Plain data
only: a scenario crosses into worker processes as JSON.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = {
    "read_file": "Read a file of the repository. Arguments: path (string), start_line (int), end_line (int).",
    "grep": "Search the repository for a regular expression. Arguments: pattern (string), glob (string).",
    "run_tests": "Run the test suite or one test. Arguments: target (string), timeout_s (int).",
    "edit_file": "Replace a range of lines of a file. Arguments: path, start_line, end_line, text.",
    "list_dir": "List a directory. Arguments: path (string), depth (int).",
    "shell": "Run a shell command in the sandbox. Arguments: command (string), timeout_s (int).",
    "web_search": "Search internal documentation. Arguments: query (string), top_k (int).",
}

USER_ASKS = [
    "The nightly job failed again. Can you find out why {name} raises on empty input?",
    "Please look at {name} and tell me whether the retry logic can loop forever.",
    "Our customer reports slow responses from {name}. Where is the time going?",
    "Refactor {name} so that the parser and the I/O are separate, keep the behaviour.",
    "Why does {name} hold the lock while it logs? Is that safe to change?",
    "Add a test for the timeout path in {name} and make sure it fails first.",
]

FOLLOW_UPS = [
    "Good. Now check the callers of that function as well.",
    "That matches what I saw in the logs. What would the smallest fix be?",
    "Run the tests for that module and show me what fails.",
    "Could this also happen on Windows paths?",
    "Keep going, but do not change the public API.",
]

RESUME_QUESTIONS = [
    "Root cause?",
    "Which file first?",
]


@dataclass(frozen=True, slots=True)
class Message:
    role: str  #: system | user | tool
    text: str
    max_tokens: int  #: the worker cuts the tokenized message to this


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a session (``kind`` "turn" or "resume"), or a "restart" of the engine."""

    kind: str
    session: str = ""
    label: str = ""
    messages: list[Message] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    system_prompt: Message
    steps: list[Step]
    gen_tokens: int  #: greedy tokens generated per request (the assistant's reply)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Scenario":
        steps = [Step(s["kind"], s["session"], s["label"], [Message(**m) for m in s["messages"]]) for s in data["steps"]]
        return cls(data["name"], Message(**data["system_prompt"]), steps, data["gen_tokens"])


class _Texts:
    """Deterministic text pieces from the standard library's sources."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        self.files = [p for p in sorted(stdlib.glob("*.py")) if p.stat().st_size > 20_000]

    def module(self) -> Path:
        return self.rng.choice(self.files)

    def source(self, path: Path, chars: int) -> str:
        text = path.read_text(encoding="utf-8", errors="replace")
        start = self.rng.randrange(0, max(1, len(text) - chars))
        return text[start : start + chars]

    def system_prompt(self, chars: int) -> str:
        lines = [
            "You are a coding agent working in a large Python repository for a team of engineers.",
            "Work step by step. Use the tools below; never guess a file's content, read it.",
            "Explain what you found before you change anything, and keep changes minimal.",
            "Tools (JSON schema follows each description):",
        ]
        for name, desc in TOOLS.items():
            lines.append(f'- {name}: {desc}\n  {{"name": "{name}", "parameters": {{"type": "object"}}}}')
        lines.append("Repository conventions, excerpted from the style guide and code:")
        text = "\n".join(lines) + "\n"
        while len(text) < chars:
            text += self.source(self.module(), 1500) + "\n"
        return text

    def test_log(self, name: str, chars: int) -> str:
        out = [f"$ pytest tests/test_{name}.py -q"]
        i = 0
        while sum(len(x) for x in out) < chars:
            i += 1
            status = self.rng.choice(["PASSED", "PASSED", "PASSED", "FAILED", "ERROR"])
            out.append(f"tests/test_{name}.py::test_case_{i} {status} [{self.rng.randint(1, 99)}%]")
            if status != "PASSED":
                out.append(self.source(self.module(), 300))
        return "\n".join(out)


def _read(texts: _Texts, path: Path, tokens: int) -> Message:
    return Message("tool", f"read_file({path.name}) ->\n" + texts.source(path, tokens * 6), tokens)


def _user(text: str, tokens: int = 96) -> Message:
    return Message("user", text, tokens)


def quick_scenario(seed: int = 7) -> Scenario:
    """About a minute here: a long session that resumes, two short ones, one restart."""
    t = _Texts(seed)
    a, b, c = t.module(), t.module(), t.module()
    ask = lambda m: _user(t.rng.choice(USER_ASKS).format(name=m.stem))  # noqa: E731
    steps = [
        Step("turn", "alice", "asks about a long file", [ask(a), _read(t, a, 3500)]),
        Step("turn", "bob", "first question", [ask(b)]),
        Step("resume", "alice", "resume: short question", [_user(RESUME_QUESTIONS[0], 24)]),
        Step("restart"),
        Step("turn", "carol", "after restart: first question", [ask(c)]),
    ]
    return Scenario("quick", Message("system", t.system_prompt(8000), 1024), steps, gen_tokens=4)


def default_scenario(seed: int = 11) -> Scenario:
    """About two minutes here: four users; resume before and after a process restart."""
    t = _Texts(seed)
    a, b, c, d = (t.module() for _ in range(4))
    ask = lambda m: _user(t.rng.choice(USER_ASKS).format(name=m.stem))  # noqa: E731
    steps = [
        Step("turn", "alice", "first question", [ask(a)]),
        Step("turn", "bob", "first question", [ask(b)]),
        Step("turn", "carol", "first question", [ask(c)]),
        Step("turn", "alice", "reads a long file", [_read(t, a, 3400), _user(FOLLOW_UPS[0])]),
        Step("turn", "bob", "reads a file", [_read(t, b, 400)]),
        Step("turn", "dave", "first question", [ask(d)]),
        Step("turn", "carol", "greps", [Message("tool", "grep ->\n" + t.source(c, 1500), 250), _user(FOLLOW_UPS[2])]),
        Step("resume", "alice", "resume: short question", [_user(RESUME_QUESTIONS[0], 24)]),
        Step("turn", "bob", "runs the tests", [Message("tool", t.test_log(b.stem, 1500), 240), _user(FOLLOW_UPS[1])]),
        Step("restart"),
        Step("turn", "carol", "after restart", [_user(FOLLOW_UPS[3])]),
        Step("turn", "dave", "after restart: reads a file", [_read(t, d, 300), _user(FOLLOW_UPS[4])]),
        Step("resume", "alice", "resume after restart", [_user(RESUME_QUESTIONS[1], 24)]),
        Step("turn", "bob", "after restart", [_user(FOLLOW_UPS[4])]),
    ]
    return Scenario("default", Message("system", t.system_prompt(8000), 1024), steps, gen_tokens=8)
