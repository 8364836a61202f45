"""What the owner of one request holds for it while it is answered, as the steps it calls see
it: the ticket, the watch, the pump's state, the meter, and the exit stack that releases it all."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass

from appliance.admission.usage import Meter
from appliance.proxy.pump import Pump
from appliance.proxy.request import RelayDeps, Ticket
from appliance.proxy.watch import Watch


@dataclass(frozen=True, eq=False)
class Held:
    """Passed to each step (send, pump, recover); only the owner (appliance.proxy.relay) makes
    one, and leaving its `stack` releases whatever the steps entered into it."""

    ticket: Ticket
    deps: RelayDeps
    watch: Watch
    pump: Pump
    meter: Meter
    stack: AsyncExitStack
