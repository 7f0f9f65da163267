"""Mobile link profiles: the numbers the rig's link emulator and the split-point planner both read.

A profile is what one phone's path to the cloud looks like: round-trip propagation time, jitter, bandwidth
each way, and the fraction of TCP segments that need a retransmission. The sources of each number are in
``docs/rig.md`` ("Link profiles"); they are medians of public crowd-sourced measurements (Ookla Speedtest,
Opensignal) and WebPageTest's throttling presets, not a promise about any one network.

No torch, no numpy: the planner (partition_tools) and the rig both import this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LinkProfileError(ValueError):
    """A link profile value is out of range, or the name is unknown; the message names the field."""


MAX_DELAY_MS = 60_000.0  # rtt_ms, jitter_ms, rto_ms: beyond a minute no connection would ever open
# 1 kbit/s .. 1 Tbit/s: the loopback pass-through's 1e6, and the most an edge client's link hint (EdgeConfig.link_kbps,
# at most 1e9 kbit/s on the wire) can say - the rig tells its split phones their link's uplink
MIN_MBPS, MAX_MBPS = 0.001, 1e6


@dataclass(frozen=True, slots=True)
class LinkProfile:
    name: str
    rtt_ms: float  # round-trip propagation time (each direction gets half): what a 1-byte ping sees
    jitter_ms: float  # one-way delay varies uniformly in [-jitter, +jitter] per segment (netem's default)
    down_mbps: float  # cloud -> phone bandwidth (megabits/s): serialization delay = bytes * 8 / bandwidth
    up_mbps: float  # phone -> cloud: mobile uplinks are 3-10x slower than downlinks, and we upload activations
    loss: float  # fraction of TCP segments lost once and retransmitted (each costs `rto_ms` of extra delay)
    rto_ms: float = 200.0  # Linux's minimum retransmission timeout: the delay spike a lost segment shows
    source: str = ""  # one line: where the numbers come from (details in docs/rig.md)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise LinkProfileError(f"link profile needs a name (a non-empty string), got {self.name!r}")
        if not isinstance(self.source, str):
            raise LinkProfileError(f"link profile {self.name}: source must be a string, got {self.source!r}")
        for field in ("rtt_ms", "jitter_ms", "rto_ms", "down_mbps", "up_mbps", "loss"):
            value = getattr(self, field)  # NaN passes every comparison below, inf sleeps forever, "60" breaks later
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise LinkProfileError(f"link profile {self.name}: {field} must be a finite number, got {value!r}")
        for field in ("rtt_ms", "jitter_ms", "rto_ms"):
            if not 0 <= getattr(self, field) <= MAX_DELAY_MS:
                raise LinkProfileError(f"link profile {self.name}: {field} must be in [0, {MAX_DELAY_MS:.0f}], "
                                       f"got {getattr(self, field)}")
        for field in ("down_mbps", "up_mbps"):
            if not MIN_MBPS <= getattr(self, field) <= MAX_MBPS:
                raise LinkProfileError(f"link profile {self.name}: {field} must be in [{MIN_MBPS:g}, {MAX_MBPS:g}], "
                                       f"got {getattr(self, field)}")
        if not 0.0 <= self.loss < 1.0:
            raise LinkProfileError(f"link profile {self.name}: loss must be in [0, 1), got {self.loss}")
        if self.jitter_ms > self.rtt_ms / 2:
            raise LinkProfileError(f"link profile {self.name}: jitter_ms ({self.jitter_ms}) above the one-way "
                                   f"delay ({self.rtt_ms / 2}) would make delays negative")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    def up_seconds(self, nbytes: float) -> float:
        """Serialization time of ``nbytes`` on the uplink."""
        return nbytes * 8.0 / (self.up_mbps * 1e6)

    def down_seconds(self, nbytes: float) -> float:
        return nbytes * 8.0 / (self.down_mbps * 1e6)

    def expected_extra_s(self, segments: float) -> float:
        """Mean retransmission delay added to a message of ``segments`` TCP segments (head-of-line: one lost
        segment delays the whole message by one RTO)."""
        p_any = 1.0 - (1.0 - self.loss) ** max(1.0, segments)
        return p_any * self.rto_ms / 1000.0

    def to_dict(self) -> dict:
        return {"name": self.name, "rtt_ms": self.rtt_ms, "jitter_ms": self.jitter_ms,
                "down_mbps": self.down_mbps, "up_mbps": self.up_mbps, "loss": self.loss, "rto_ms": self.rto_ms,
                "source": self.source}


MSS = 1448  # TCP payload bytes per segment on a 1500-byte MTU path with timestamps

PROFILES: dict[str, LinkProfile] = {p.name: p for p in (
    # Wi-Fi behind a home fixed line to a cloud region nearby. Ookla's Speedtest Global Index put the global
    # fixed-broadband average at 84 / 44 Mbps (Aug 2020); a Wi-Fi hop and a congested evening halve it.
    LinkProfile("wifi", rtt_ms=20.0, jitter_ms=3.0, down_mbps=50.0, up_mbps=20.0, loss=0.001,
                source="Ookla Speedtest Global Index fixed broadband (Aug 2020: 84/44 Mbps), halved for Wi-Fi"),
    # Ookla Speedtest Intelligence, Q3 2021: global median 5G 166 Mbps down, 21 Mbps up. RTT: 3GPP TR 38.913
    # sets 4 ms one-way on the radio; the core network and the path to a cloud region add the rest.
    LinkProfile("5g", rtt_ms=30.0, jitter_ms=5.0, down_mbps=166.0, up_mbps=21.0, loss=0.002,
                source="Ookla Speedtest Intelligence Q3 2021 global 5G medians (166/21 Mbps); RTT assumed"),
    # Opensignal, State of Mobile USA (May 2019): 4G average 21.3 Mbps down, 6.3 Mbps up, latency 44-66 ms.
    LinkProfile("4g", rtt_ms=60.0, jitter_ms=8.0, down_mbps=21.0, up_mbps=6.3, loss=0.005,
                source="Opensignal State of Mobile USA, May 2019 (21.3/6.3 Mbps, 44-66 ms)"),
    # WebPageTest's "3G Slow" preset (WPO-Foundation connectivity.ini): 400 kbps each way, 400 ms RTT; a cell
    # edge also loses segments (2 %).
    LinkProfile("3g-poor", rtt_ms=400.0, jitter_ms=40.0, down_mbps=0.4, up_mbps=0.4, loss=0.02,
                source="WebPageTest '3G Slow' preset (400/400 kbps, 400 ms RTT), 2 % loss assumed"),
)}


def get_profile(name: str) -> LinkProfile:
    """The built-in profile ``name`` (wifi, 5g, 4g, 3g-poor)."""
    if not isinstance(name, str) or name not in PROFILES:  # (a list from YAML raised "unhashable type")
        raise LinkProfileError(f"unknown link profile {name!r}: expected one of {', '.join(PROFILES)}")
    return PROFILES[name]
