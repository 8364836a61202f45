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
request that has been there longest, if it was there when those slow tokens began (then the
next, if the steps stay slow). A request alone
costs only itself and is left to finish.

Where the time per token comes from: the streams the relay forwards. In a batch each running
request gets one token per step, so the gaps between a stream's events are the engine's step
times. A non-streamed request shows no progress, so it is watched through the streams beside
it: a costly non-streamed request is caught by a streamed peer's gaps; among non-streamed
requests only, nothing is measured and nothing is aborted. The norm is the median gap of the
last streams seen while no constrained request was at the engine (so that a costly one cannot
raise its own bar), never below `slow_norm_floor_s`, which also stands in for it until a gap
has been seen.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from prometheus_client import Counter

from appliance.errors import ApiError, BadRequest
from appliance.settings import ConstraintSettings

log = structlog.get_logger("appliance.cost")

_NORM_GAPS = 256  # the gaps the norm is the median of


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

    def progressed(self, events: int) -> None:
        """`events` stream events arrived together (one token each, lately). Once per token
        while the request is `measuring`: while no constrained request is at the engine, a gap
        only feeds the norm (one that began then can never make a window that condemns a
        constrained request, as none was at the engine when it began; see CostWatch.judge)."""
        if not self.measuring:
            return  # not timed now, or aborted (what still arrives before the cancellation lands)
        watch = self.watch
        now = watch.clock()
        last, self.last_event = self.last_event, now
        self.tokens += events
        if last is None:
            return  # the first is the queue's and the prefill's time
        gap = (now - last) / (events or 1)
        if not watch.constrained:
            watch.norm.append(gap)
            return
        if self.gaps is None or self.began is None:
            window = watch.window
            self.gaps, self.began = deque(maxlen=window), deque(maxlen=window)
        self.gaps.append(gap)
        self.began.append(last)
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

    def follow(self, constraint: str | None, abort: Callable[[], None], *,
               engine_work: bool = True, streamed: bool = True) -> Followed:
        """The request at the engine until the returned Followed is left (a context manager).
        `constraint` names its output constraint (the gate found it), None if it has none.
        `abort` cancels its exchange; a peer that comes while the engine is already slow gets
        the costly one aborted at once. A request that is no engine work (a pass-through:
        models, tokenize, a stored response) is not followed."""
        followed = Followed(self, self.clock(), constraint, abort, streamed=streamed)
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
        suspect = next((f for f in self._at_engine
                        if f.constraint is not None and f.since <= slow.began[0]), None)
        if suspect is None or suspect.constraint is None:
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
