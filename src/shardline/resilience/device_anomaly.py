"""The anomaly check on the device: no per-step host sync (anomaly.check_on = device).

The host check reads the loss and gradient norm every step, which stalls a GPU's
queue once per step. Here the same verdict (non-finite loss or gradient norm, or a
robust z-score above anomaly.spike_zscore, exactly as AnomalyDetector computes it) is
a tensor on the device, and it gates the update through the fused AdamW kernel's
`found_inf` input (the mechanism fp16 loss scaling uses): a flagged step changes no
parameter, moment or step count. The host reads the verdicts only when it logs, and
reports the anomalies then. Only anomaly.action = skip can work this way: rollback
and halt must act on the host at once.
"""

from __future__ import annotations

import torch

from shardline.config.resilience import AnomalyConfig


class DeviceAnomalyCheck:
    on_device = True

    def __init__(self, cfg: AnomalyConfig, device: torch.device):
        self.cfg = cfg
        self.history = torch.full((cfg.window,), float("inf"), device=device)  # inf marks an empty slot
        self.count = torch.zeros((), dtype=torch.long, device=device)  # healthy losses seen (capped at window)
        self.next = torch.zeros((), dtype=torch.long, device=device)  # ring position of the next one
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, [bad, kind, value, loss]) not yet read

    def gate(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 when this step is anomalous, else 0.0 (a device tensor); records a healthy loss."""
        loss, grad_norm = loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())
        bad_loss, bad_norm = ~torch.isfinite(loss), ~torch.isfinite(grad_norm)
        z = self._zscore(loss)
        spike = (self.count >= self.cfg.min_history) & (z > self.cfg.spike_zscore) & (self.cfg.spike_zscore > 0)
        bad = bad_loss | bad_norm | spike
        # The kinds in the host detector's order of precedence: loss, then norm, then spike.
        kind = torch.where(bad_loss, 1, torch.where(bad_norm, 2, torch.where(spike, 3, 0)))
        value = torch.where(bad_loss, loss, torch.where(bad_norm, grad_norm, z))
        self._accept(loss, ~bad)
        self.pending.append((step, torch.stack([bad.float(), kind.float(), value, loss])))
        return bad.float()

    def _zscore(self, loss: torch.Tensor) -> torch.Tensor:
        n = self.count.clamp(min=1)
        values = self.history.sort().values  # empty slots (inf) sort last
        median = _median(values, n)
        deviations = torch.where(torch.isinf(values), float("inf"), (values - median).abs()).sort().values
        mad = _median(deviations, n)
        scale = torch.maximum(1.4826 * mad, 1e-3 * median.abs()).clamp_min(1e-8)
        return (loss - median) / scale

    def _accept(self, loss: torch.Tensor, healthy: torch.Tensor) -> None:
        slot = self.history.index_select(0, self.next.reshape(1)).reshape(())  # indexing by a tensor would sync
        self.history.index_copy_(0, self.next.reshape(1), torch.where(healthy, loss, slot).reshape(1))
        step = healthy.long()
        self.next.copy_((self.next + step) % self.cfg.window)
        self.count.copy_((self.count + step).clamp(max=self.cfg.window))

    def drain(self) -> list[dict]:
        """Read the verdicts since the last call (one host sync); the anomalous ones as events."""
        if not self.pending:
            return []
        steps = [s for s, _ in self.pending]
        verdicts = torch.stack([v for _, v in self.pending]).cpu().tolist()
        self.pending = []
        kinds = {1: "nonfinite_loss", 2: "nonfinite_grad_norm", 3: "loss_spike"}
        return [{"step": s, "anomaly": kinds[int(k)], **({"zscore": v, "loss": loss} if k == 3 else {"value": v})}
                for s, (bad, k, v, loss) in zip(steps, verdicts) if bad]  # (as the host check's events name them)

    def state_dict(self) -> dict:
        """The healthy-loss history, oldest first, as the host detector keeps it."""
        n, nxt = int(self.count), int(self.next)
        ring = self.history.cpu().tolist()
        ordered = ring[nxt:] + ring[:nxt] if n == self.cfg.window else ring[:n]
        return {"history": ordered}

    def load_state_dict(self, state: dict) -> None:
        history = state.get("history", [])[-self.cfg.window:]
        self.history.fill_(float("inf"))
        if history:
            self.history[: len(history)] = torch.tensor(history, device=self.history.device)
        self.count.fill_(len(history))
        self.next.fill_(len(history) % self.cfg.window)


def _median(sorted_values: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Median of the first n of sorted values (mean of the two middle ones when n is even)."""
    middle = torch.stack([(n - 1) // 2, n // 2])  # gathered on the device: indexing by a tensor syncs
    return 0.5 * sorted_values.index_select(0, middle).sum()
