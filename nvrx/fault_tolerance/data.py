"""Workload-control requests a rank sends its supervisor, and the timeouts a client reports (NVRx's ``fault_tolerance.data`` names)."""

from __future__ import annotations

import dataclasses
import enum


class WorkloadAction(enum.Enum):
    """What a rank asks the launcher side to do."""

    Continue = 0  # nothing: carry on
    ExcludeThisNode = 1  # this node leaves the job; it is treated as lost (spare or stop)
    ShutdownWorkload = 2  # every node stops its ranks cleanly; the job ends with exit 0


@dataclasses.dataclass(frozen=True)
class WorkloadControlRequest:
    """``action``, and ``description``: why (recorded in the events and the job's stop reason)."""

    action: WorkloadAction
    description: str = ""





@dataclasses.dataclass
class HeartbeatTimeouts:
    """The heartbeat timeouts in force (``RankMonitorClient.hb_timeouts``), seconds; None: unchecked.

    ``initial``: to the first heartbeat; ``subsequent``: between two heartbeats;
    ``were_calculated``: computed from observations rather than configured.
    """

    initial: float | None = None
    subsequent: float | None = None
    were_calculated: bool | None = None

    @property
    def are_valid(self) -> bool:
        """Both timeouts are set."""
        return self.initial is not None and self.subsequent is not None


@dataclasses.dataclass
class SectionTimeouts:
    """The section timeouts in force (``RankMonitorClient.section_timeouts``), seconds; None: unchecked.

    ``section``: per section name; ``out_of_section``: outside every section;
    ``calculated_sections`` and ``is_out_of_section_calculated`` say which were computed.
    """

    section: dict[str, float | None] = dataclasses.field(default_factory=dict)
    out_of_section: float | None = None
    calculated_sections: set[str] = dataclasses.field(default_factory=set)
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        self.calculated_sections = set(self.calculated_sections)

    @property
    def were_calculated(self) -> bool:
        """Every section's timeout and the out-of-section one were computed."""
        return self.calculated_sections == set(self.section) and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        """Every timeout is set."""
        return all(v is not None for v in self.section.values()) and self.out_of_section is not None
__all__ = ["HeartbeatTimeouts", "SectionTimeouts", "WorkloadAction", "WorkloadControlRequest"]
