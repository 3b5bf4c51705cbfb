"""Traffic that repeats itself (issue 27): multi-turn conversations whose users share system prompts,
and documents asked several questions. What a prefix cache is for.

A *session* arrives (Gamma arrivals, ``rate`` sessions a second, coefficient of variation ``cv``) and is
either a conversation (share ``chat_share``) or one question about a document:

- a conversation belongs to one of ``num_groups`` groups (an app, a tenant) whose users share one
  system prompt; each of its 3-8 turns sends the whole history (system prompt, every earlier user
  message and reply) plus a new user message, after the previous reply and a think time
  (exponential, mean ``think_s``). The client re-sends the reply's own token ids (``return_token_ids``),
  as a chat client re-sends the assistant's message; a conversation ends early where its next turn
  would not fit ``max_model_len``.
- a question picks one of ``num_documents`` documents and sends it with a question of its own.

Token ids are random (seeded), so the sharing is exactly what this describes and nothing else. The
trace says what to send and when; what comes back (the replies) is the server's, so the client builds
each turn's prompt as it goes (``benchmarks/prefix_reuse.py``).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

import numpy as np

from apt_serve_ray.bench.workloads import Uniform, _arrival_times, _check_arrivals


@dataclass(frozen=True)
class SessionClass:
    name: str
    ttft_slo_ms: float
    tbt_slo_ms: float
    priority: int


CHAT = SessionClass("chat", 2000.0, 500.0, 0)
DOCUMENT = SessionClass("document", 8000.0, 1000.0, 10)


@dataclass(frozen=True)
class ConversationSpec:
    num_sessions: int = 40
    chat_share: float = 0.75
    num_groups: int = 3
    system_len: Uniform = Uniform(200, 1000)
    user_len: Uniform = Uniform(20, 120)
    output_len: Uniform = Uniform(32, 128)
    turns: Uniform = Uniform(3, 8)
    think_s: float = 5.0
    num_documents: int = 3
    document_len: Uniform = Uniform(800, 1400)
    question_len: Uniform = Uniform(20, 60)
    answer_len: Uniform = Uniform(32, 96)
    max_model_len: int = 2048
    vocab_size: int = 49152


@dataclass
class Session:
    session_id: str
    start_s: float
    service: SessionClass
    prefix: list[int]  # the shared part: a group's system prompt, or a document
    messages: list[list[int]]  # one user message (or the question) a turn
    output_lens: list[int]
    think_s: list[float] = field(default_factory=list)  # after each turn but the last
    group: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.messages)


def relabel(sessions: list[Session], key: int, vocab_size: int) -> list[Session]:
    """The same sessions in other tokens: every id mapped through one permutation of the ids
    ``make_sessions`` draws from, chosen by ``key``. Lengths, timing and sharing (within the
    sessions) are kept; what another key's sessions computed is no help. So several rates run on one
    server one after another each start from a cache that holds none of their prompts."""
    perm = np.arange(vocab_size)
    perm[10:] = 10 + np.random.default_rng(key).permutation(vocab_size - 10)
    mapped = lambda ids: perm[np.asarray(ids, dtype=np.int64)].tolist()  # noqa: E731
    prefixes: dict[int, list[int]] = {}  # one list per shared prefix, as make_sessions gives them
    for s in sessions:
        if id(s.prefix) not in prefixes:
            prefixes[id(s.prefix)] = mapped(s.prefix)
    return [dataclasses.replace(s, prefix=prefixes[id(s.prefix)], messages=[mapped(m) for m in s.messages])
            for s in sessions]


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(10, vocab, size=n).tolist()


def _one(dist: Uniform, rng: np.random.Generator) -> int:
    return int(dist.sample(rng, 1)[0])


def make_sessions(spec: ConversationSpec, rate: float, cv: float = 1.0, seed: int = 0) -> list[Session]:
    """``spec.num_sessions`` sessions arriving at ``rate`` a second (their contents do not depend on
    ``rate``: one seed gives the same sessions at every rate, re-timed)."""
    if not 0.0 <= spec.chat_share <= 1.0:
        raise ValueError(f"chat_share: must be in [0, 1], got {spec.chat_share}")
    rng = np.random.default_rng(seed)
    vocab = spec.vocab_size
    systems = [_ids(rng, _one(spec.system_len, rng), vocab) for _ in range(spec.num_groups)]
    documents = [_ids(rng, _one(spec.document_len, rng), vocab) for _ in range(spec.num_documents)]
    sessions = []
    for i in range(spec.num_sessions):
        if rng.random() < spec.chat_share:
            group = int(rng.integers(spec.num_groups))
            prefix = systems[group]
            num_turns = _one(spec.turns, rng)
            messages = [_ids(rng, _one(spec.user_len, rng), vocab) for _ in range(num_turns)]
            outputs = [_one(spec.output_len, rng) for _ in range(num_turns)]
            total, kept = len(prefix), 0
            for message, out in zip(messages, outputs):  # the history must fit the context
                if total + len(message) + out >= spec.max_model_len:
                    break
                total += len(message) + out
                kept += 1
            messages, outputs = messages[:max(1, kept)], outputs[:max(1, kept)]
            think = rng.exponential(spec.think_s, size=len(messages) - 1).tolist()
            sessions.append(Session(f"c{i}", 0.0, CHAT, prefix, messages, outputs, think, group))
        else:
            doc = int(rng.integers(spec.num_documents))
            sessions.append(Session(f"d{i}", 0.0, DOCUMENT, documents[doc],
                                    [_ids(rng, _one(spec.question_len, rng), vocab)],
                                    [_one(spec.answer_len, rng)], [], doc))
    return with_session_rate(sessions, rate, cv, seed)


def with_session_rate(sessions: list[Session], rate: float, cv: float = 1.0, seed: int = 0) -> list[Session]:
    """The same sessions, re-timed: Gamma arrivals at ``rate`` sessions a second."""
    _check_arrivals(len(sessions), rate, cv)
    starts = _arrival_times(len(sessions), rate, cv, np.random.default_rng([seed, 7]))
    return [Session(s.session_id, float(t), s.service, s.prefix, s.messages, s.output_lens, s.think_s, s.group)
            for s, t in zip(sessions, starts)]


def shared_token_share(sessions: list[Session]) -> float:
    """Of all prompt tokens the sessions will send (replies counted at their length), the share an
    ideal cache would hold already: every repeated prefix, every earlier turn. An upper bound on the hit
    rate (a real cache loses what it evicts, and pages are not filled to the token)."""
    seen: set[int] = set()
    total = shared = 0
    for s in sorted(sessions, key=lambda s: s.start_s):
        extra = 0  # the conversation beyond its prefix so far
        for turn, (message, out) in enumerate(zip(s.messages, s.output_lens)):
            total += len(s.prefix) + extra + len(message)
            shared += (len(s.prefix) if turn or id(s.prefix) in seen else 0) + extra
            extra += len(message) + out
        seen.add(id(s.prefix))
    return shared / total if total else 0.0


def replay_simulated(sim, sessions: list[Session]) -> list:
    """The sessions on the simulated clock: each turn arrives at its time (the first at the session's
    start, the next a think time after the previous reply), with the history re-sent: the replies are
    the simulator's one token id repeated, so the history is still the conversation's own. Records as
    ``http_client.run_sessions`` gives them: ``(session, turn, timeline, cached tokens)``."""
    from apt_serve_ray.bench.simulator import OUTPUT_TOKEN_ID as reply_token
    from apt_serve_ray.bench.slo_metrics import RequestTimeline as Timeline

    pending = sorted(((s.start_s, s.session_id, s, 0, list(s.prefix)) for s in sessions), key=lambda e: e[:2])
    live, records = {}, []
    while pending or live:
        if not live and pending and pending[0][0] > sim.now:
            sim.now = pending[0][0]
        while pending and pending[0][0] <= sim.now:
            _, _, s, turn, history = pending.pop(0)
            prompt = history + s.messages[turn]
            r = sim.add(0, s.output_lens[turn], prompt_token_ids=prompt, ttft_slo_ms=s.service.ttft_slo_ms,
                        tbt_slo_ms=s.service.tbt_slo_ms, priority=s.service.priority)
            live[r.request_id] = (s, turn, prompt, r)
        sim.step()
        for rid in [rid for rid, (*_, r) in live.items() if r.is_finished]:
            s, turn, prompt, r = live.pop(rid)
            t = Timeline(rid, r.arrival_time, r.first_token_time, list(r.token_times), r.finish_time,
                         len(prompt), len(r.output_token_ids), ttft_slo_ms=s.service.ttft_slo_ms,
                         tbt_slo_ms=s.service.tbt_slo_ms)
            records.append((s, turn, t, r.num_cached_tokens or 0))
            if turn + 1 < s.num_turns:
                at = sim.now + s.think_s[turn]
                pending.append((at, s.session_id, s, turn + 1, prompt + [reply_token] * len(r.output_token_ids)))
                pending.sort(key=lambda e: e[:2])
    return records
