"""Run-time cost of output constraints: a constrained request that keeps the engine's steps far
slower than their norm while another request shares the engine is aborted (request_too_costly).

Why steps, and why constrained requests. vLLM runs the requests at the engine in one batch and
computes each constrained request's token mask inside the shared step, so a costly constraint
slows every request's tokens alike: no request's own rate tells it apart from its peers. What
tells it apart is its class: an output constraint is the one part of a request whose per-token
work the gate cannot bound (the static vetting bounds its size and nesting; an ambiguous
grammar within them still grows costlier with each token: measured on the CPU worker,
`s ::= s s s | s s | [a-z ]` went from 0.05 to 0.36 s a token in 40 tokens). So the watch
measures the engine's time per token, and when it stays above `slow_factor` x its norm for
`slow_tokens` tokens while more than one request is at the engine, it aborts the constrained
request whose stay has been slowest: of those there when the slow tokens began, the one with
the highest mean time per token since it came (a cheap constraint that ran at the norm before
a costly one came has a lower mean than the costly one; the latest to come on a tie: its coming
is what changed the pace). Then the next, if the steps stay slow. A request alone costs only
itself and is left to finish.

Where the time per token comes from: the streams the relay forwards. In a batch each running
request gets one token per step, so a stream's time per token is the engine's step time. An
event may carry several tokens (a client's `stream_interval`, or outputs vLLM merged while the
reader lagged), so a gap is divided by the tokens the event carries: counted from its
`token_ids` (vLLM's `return_token_ids`, which the gate asks of every chat and completions
stream it can resume; a few C-level byte searches per event, and only for the streams timed
now), else taken as the request's `stream_interval` per event (what vLLM sends). An event
that carries no token (a role, a usage or an empty final event) marks no step. A non-streamed
request shows no progress, so it is watched through the streams beside it: a costly
non-streamed request is caught by a streamed peer's gaps; among non-streamed requests only,
nothing is measured and nothing is aborted. The norm is the median gap of the
last streams seen while no constrained request was at the engine (so that a costly one cannot
raise its own bar), never below `slow_norm_floor_s`, which also stands in for it until a gap
has been seen.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import Counter

from appliance.core.errors import ApiError, BadRequest
from appliance.core.sections import ConstraintSettings

log = structlog.get_logger("appliance.cost")

_NORM_GAPS = 256  # the gaps the norm is the median of
_IDS = b'"token_ids":['  # an event's generated ids (not `"prompt_token_ids":[`: no quote before)
_IDS_SIZE = len(_IDS)
_EVENT = b"data:"


def tokens_per_event(payload: Mapping[str, Any]) -> int:
    """What vLLM sends a request in one event when its ids are not there to count: its
    `stream_interval` tokens (the last event may carry fewer)."""
    interval = payload.get("stream_interval")
    return interval if isinstance(interval, int) and interval > 1 else 1


def tokens_in(chunk: bytes, per_event: int) -> int:
    """The tokens a read of a stream carries: its events' generated ids where they are there,
    else `per_event` per event."""
    start = chunk.find(_IDS)
    if start < 0:
        return chunk.count(_EVENT) * per_event
    tokens = 0
    while start >= 0:
        start += _IDS_SIZE
        end = chunk.find(b"]", start)
        if end < 0:
            break  # cut off mid-list: the rest comes with the next read (its tokens count then)
        if end > start:
            tokens += chunk.count(b",", start, end) + 1
        start = chunk.find(_IDS, end)
    return tokens


@dataclass(frozen=True)
class Verdict:
    """Why a request was aborted: the numbers the log line, the error and the metric carry."""

    param: str  # the constraint that makes it the suspect
    step_s: float  # the engine's time per token (per step), lately
    norm_s: float
    bound_s: float
    streamed: int  # the tokens it was seen to stream (0 for a non-streamed request)
    at_engine_s: float
    peers: int  # other requests at the engine

    def logged(self) -> ApiError:
        """Logs the abort (in the aborted request's own context: its request id) and returns
        its error."""
        # No field named "token...": the log masks those as secrets.
        log.warning("request.too_costly", param=self.param, step_s=round(self.step_s, 3),
                    norm_s=round(self.norm_s, 4), bound_s=round(self.bound_s, 3),
                    streamed=self.streamed, at_engine_s=round(self.at_engine_s, 2),
                    peers=self.peers)
        return BadRequest(
            f"the request was stopped: while it ran, the engine took {self.step_s:.2f} s a token "
            f"(its norm {self.norm_s:.3f} s; bound {self.bound_s:.2f} s, settings "
            f"constraints.slow_factor and slow_norm_floor_s) with other requests waiting; "
            f"'{self.param}' is too costly for this engine", param=self.param,
            code="request_too_costly")


@dataclass(eq=False, slots=True)
class Followed:
    """One request at the engine, as the watch sees it; the relay reports its stream's events."""

    watch: CostWatch
    since: float
    constraint: str | None  # the parameter of its output constraint; None: unconstrained
    abort: Callable[[], None]
    per_event: int = 1  # the tokens an event carries when it has no ids to count
    # Seconds a token, its last few, and when each began: made at its first judged gap (most
    # requests never meet a constrained one, and two deques cost a quarter of following one).
    gaps: deque[float] | None = None
    began: deque[float] | None = None
    streamed: bool = True  # its events are seen (a non-streamed answer shows no progress)
    last_event: float | None = None
    tokens: int = 0
    watched: bool = True  # at the engine, not yet aborted: its progress is judged
    measuring: bool = False  # its tokens are timed now (CostWatch.timed): the relay asks first
    verdict: Verdict | None = field(default=None)
    # A constrained request: the watch's judged seconds and gaps when it came (CostWatch.paced).
    came_s: float = 0.0
    came_gaps: int = 0

    def progressed(self, chunk: bytes) -> None:
        """A read of its stream went to the client. Once per read while the request is
        `measuring`: while no constrained request is at the engine, a gap only feeds the norm
        (one that began then can never make a window that condemns a constrained request, as
        none was at the engine when it began; see CostWatch.judge)."""
        if not self.measuring:
            return  # not timed now, or aborted (what still arrives before the cancellation lands)
        tokens = tokens_in(chunk, self.per_event)
        if not tokens:
            return  # no token in it: no step's mark
        watch = self.watch
        now = watch.clock()
        last, self.last_event = self.last_event, now
        self.tokens += tokens
        if last is None:
            return  # the first is the queue's and the prefill's time
        gap = (now - last) / tokens
        if not watch.constrained:
            watch.norm.append(gap)
            return
        if self.gaps is None or self.began is None:
            window = watch.window
            self.gaps, self.began = deque(maxlen=window), deque(maxlen=window)
        self.gaps.append(gap)
        self.began.append(last)
        watch.judged_s += gap
        watch.judged += 1
        watch.judge()

    def __enter__(self) -> Followed:
        return self

    def __exit__(self, *_: object) -> None:
        self.watch.forget(self)


class CostWatch:
    """Every request at the engine, their time per token, and the abort of a costly one."""

    def __init__(self, limits: ConstraintSettings, aborted: Counter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = limits
        self._aborted = aborted
        self.clock = clock
        self.norm: deque[float] = deque(maxlen=_NORM_GAPS)  # gaps while none is constrained
        self._at_engine: list[Followed] = []  # oldest first
        self.constrained = 0  # of them: while none is, an event costs no look at the others
        self._timer: Followed | None = None  # the stream that times the steps for the norm
        # Every gap judged so far (while a constrained request was there), summed: a
        # constrained request's mean time per token since it came is from two differences.
        self.judged_s = 0.0
        self.judged = 0

    def follow(self, constraint: str | None, abort: Callable[[], None], *,
               engine_work: bool = True, streamed: bool = True, per_event: int = 1) -> Followed:
        """The request at the engine until the returned Followed is left (a context manager).
        `constraint` names its output constraint (the gate found it), None if it has none.
        `abort` cancels its exchange; a peer that comes while the engine is already slow gets
        the costly one aborted at once. A request that is no engine work (a pass-through:
        models, tokenize, a stored response) is not followed. `per_event`: tokens_per_event."""
        followed = Followed(self, self.clock(), constraint, abort, per_event, streamed=streamed,
                            came_s=self.judged_s, came_gaps=self.judged)
        if not engine_work:
            followed.watched = False
            return followed
        first_constrained = constraint is not None and not self.constrained
        if first_constrained:
            self._restart_windows()  # gaps kept from an earlier one's time can condemn nobody
        self._at_engine.append(followed)
        self.constrained += constraint is not None
        self.timed(everyone=first_constrained, newcomer=followed)
        try:
            self.judge()
        except BaseException:
            self.forget(followed)
            raise
        return followed

    @property
    def window(self) -> int:
        """The tokens a stream's slow gaps are judged over (constraints.slow_tokens)."""
        return self._limits.slow_tokens

    def forget(self, followed: Followed) -> None:
        """The request left the engine (Followed's exit)."""
        if followed.watched:  # an aborted one already is forgotten
            followed.watched = followed.measuring = False
            self._at_engine.remove(followed)
            self.constrained -= followed.constraint is not None
            if followed is self._timer:
                self._timer = None
            # The last constrained one gone: the oldest stream alone times the steps again.
            self.timed(everyone=followed.constraint is not None and not self.constrained)

    def timed(self, everyone: bool = False, newcomer: Followed | None = None) -> None:
        """Which streams time their tokens (once per token, the relay asks `measuring` first):
        while a constrained request is at the engine, every stream (each is judged); else the
        oldest alone, for the norm (a step gives each request at the engine a token: one
        stream's gaps are the steps). A stream that starts timing begins no gap with its first
        token (the one before it was not timed). `everyone`: the set changed for all of them;
        else only `newcomer` joined, or the stream that timed the steps left."""
        if everyone:
            for peer in self._at_engine:
                _timing(peer, bool(self.constrained) or peer is self._timer)
        elif newcomer is not None and self.constrained:
            _timing(newcomer, True)
        if not self.constrained and self._timer is None:
            self._timer = next((peer for peer in self._at_engine if peer.streamed), None)
            if self._timer is not None:
                _timing(self._timer, True)

    def _restart_windows(self) -> None:
        for peer in self._at_engine:  # judged again only on steps taken from now on
            if peer.gaps is not None and peer.began is not None:
                peer.gaps.clear()
                peer.began.clear()

    def paced(self, followed: Followed) -> float:
        """A constrained request's mean time per token since it came (0.0: none judged yet)."""
        gaps = self.judged - followed.came_gaps
        return (self.judged_s - followed.came_s) / gaps if gaps else 0.0

    def norm_s(self) -> float:
        floor = self._limits.slow_norm_floor_s
        return max(statistics.median(self.norm), floor) if self.norm else floor

    def judge(self) -> None:
        """Aborts the constrained request that keeps the engine slow, if one does (above)."""
        if not (self._limits.abort_when_slow and self.constrained and len(self._at_engine) > 1):
            return  # no request of the costly class, or one alone: it slows nobody else
        norm = self.norm_s()
        bound = norm * self._limits.slow_factor
        slow = next((f for f in self._at_engine
                     if f.gaps is not None and len(f.gaps) == f.gaps.maxlen
                     and min(f.gaps) > bound), None)
        if slow is None or slow.gaps is None or slow.began is None:
            return
        # Only one that was at the engine when the slow steps began can have made them slow: a
        # constrained request that comes to an engine already slow is not the cause.
        suspects = [f for f in self._at_engine
                    if f.constraint is not None and f.since <= slow.began[0]]
        if not suspects:
            return
        suspect = max(reversed(suspects), key=self.paced)  # max keeps the first: the latest
        if suspect.constraint is None:
            return
        suspect.verdict = Verdict(suspect.constraint, statistics.median(slow.gaps), norm, bound,
                                  suspect.tokens, self.clock() - suspect.since,
                                  len(self._at_engine) - 1)
        self.forget(suspect)
        self._restart_windows()  # judged again only on steps taken after this abort
        self._aborted.inc()
        suspect.abort()


def _timing(followed: Followed, on: bool) -> None:
    on = on and followed.streamed
    if on and not followed.measuring:
        followed.last_event = None  # the token before was not timed: no gap from it
    followed.measuring = on
