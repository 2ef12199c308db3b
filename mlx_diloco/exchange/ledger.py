"""What a run's exchanges cost: the bytes one worker sent, and their time on the configured link
(network.py's model), of which overlapped inner steps hide a part. The communicator records each
exchange as it finishes (comm.CollectiveRecord); the ledger adds them up, and a checkpoint keeps
its state."""

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
            rows.append({"step": step, "what": r.tag, "codec": r.codec, "algorithm": r.algorithm,
                         "payload_bytes": r.payload_bytes, "sent_bytes": r.sent_bytes,
                         "overlap_steps": r.overlap_steps, "modelled_s": modelled, "exposed_s": exposed,
                         "blocked_s": r.blocked_s, "straggler_s": r.straggler_s})
        return rows

    def state(self) -> dict:
        """What a checkpoint keeps (its meta's "exchanges")."""
        return {"bytes_sent": self.bytes_sent, "comm_s": self.comm_s, "peak_bytes": self.peak_bytes,
                "log": [list(e) for e in self.log]}

    def load_state(self, state: dict):
        self.bytes_sent, self.comm_s, self.peak_bytes = state["bytes_sent"], state["comm_s"], state["peak_bytes"]
        self.log = [tuple(e) for e in state["log"]]
