"""What a run's exchanges cost: the bytes one worker sent, and their time on the configured link
(network.py's model), of which overlapped inner steps hide a part. The communicator records each
exchange as it finishes (comm.CollectiveRecord); the ledger adds them up, and a checkpoint keeps
its state."""

from ..records import EXCHANGE
from .network import Link, exchange_time


class ExchangeLedger:
    def __init__(self, link: Link):
        self.link = link
        self.bytes_sent = 0     # by one worker
        self.comm_s = 0.0       # modelled exchange time on the link that overlap does not hide
        self.peak_bytes = 0     # the largest single exchange (bytes one worker sends)
        self.log = []           # (hops, bytes sent, overlap steps) of every exchange: its time on any link

    def record(self, step: int, records: list, step_s: float) -> list:
        """Account the exchanges that finished at `step` (comm.drain_records()); `step_s`: the mean
        compute time of an inner step, what each overlapped step hides. One row per exchange
        (what exchanges.jsonl holds)."""
        rows = []
        for r in records:
            modelled = exchange_time(r.hops, r.sent_bytes, self.link)
            exposed = max(0.0, modelled - r.overlap_steps * step_s)
            self.bytes_sent += r.sent_bytes
            self.comm_s += exposed
            self.peak_bytes = max(self.peak_bytes, r.sent_bytes)
            self.log.append((r.hops, r.sent_bytes, r.overlap_steps))
            rows.append(EXCHANGE.check({
                EXCHANGE.step: step, EXCHANGE.what: r.tag, EXCHANGE.codec: r.codec, EXCHANGE.algorithm: r.algorithm,
                EXCHANGE.payload_bytes: r.payload_bytes, EXCHANGE.sent_bytes: r.sent_bytes,
                EXCHANGE.overlap_steps: r.overlap_steps, EXCHANGE.modelled_s: modelled, EXCHANGE.exposed_s: exposed,
                EXCHANGE.blocked_s: r.blocked_s, EXCHANGE.straggler_s: r.straggler_s}))
        return rows

    def state(self) -> dict:
        """What a checkpoint keeps (its meta's "exchanges")."""
        return {"bytes_sent": self.bytes_sent, "comm_s": self.comm_s, "peak_bytes": self.peak_bytes,
                "log": [list(e) for e in self.log]}

    @classmethod
    def from_state(cls, state: dict, link: Link = None) -> "ExchangeLedger":
        """The ledger a checkpoint kept (its meta's "exchanges")."""
        ledger = cls(link)
        ledger.load_state(state)
        return ledger

    def load_state(self, state: dict):
        self.bytes_sent, self.comm_s, self.peak_bytes = state["bytes_sent"], state["comm_s"], state["peak_bytes"]
        self.log = [tuple(e) for e in state["log"]]
