"""What rank 0 shows on the terminal while training: a bar on a TTY, plain lines otherwise."""

from __future__ import annotations

from typing import Any, TextIO

_SHOWN = (  # record key, how the line shows its value
    ("lr", "lr {:.2e}"),
    ("val/accuracy", "val_acc {:.4f}"),
    ("val/perplexity", "val_ppl {:.4g}"),
    ("train/grad_norm", "grad_norm {:.3g}"),
)


def _fmt(record: dict[str, Any]) -> str:
    """One record as the progress line shows it: a training record (its loss, or that its
    batch was skipped), or an evaluation's alone (`runner eval`: no loss, no lr)."""
    parts = []
    if "train/loss" in record:
        loss = record["train/loss"]
        parts.append(f"loss {loss:.4f}" if loss is not None else "batch skipped")
    if "val/loss" in record:  # an evaluation's: with the step's, or alone (`runner eval`)
        parts.append(f"val_loss {record['val/loss']:.4f}")
    parts += [shown.format(record[key]) for key, shown in _SHOWN if key in record]
    if "throughput/tokens_per_sec" in record:
        parts.append(f"{record['throughput/tokens_per_sec']:,.0f} tokens/s")
    elif "throughput/samples_per_sec" in record:
        parts.append(f"{record['throughput/samples_per_sec']:.0f} samples/s")
    if "throughput/mfu" in record:
        parts.append(f"MFU {100 * record['throughput/mfu']:.1f}%")
    return " | ".join(parts)


class Progress:
    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None,
        enabled: bool,
        initial: int = 0,
        bar: bool = True,
    ):
        """`bar`: a bar of steps on a terminal (else plain lines there too)."""
        self.total = total_steps
        self.stream = stream if enabled else None
        self.bar = None
        if bar and self.stream is not None and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=initial,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                desc="train",
            )

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def logged(self, record: dict[str, Any]) -> None:
        if self.bar is not None:
            # a record is written once its step's figures are reduced, which may be steps
            # after the bar counted it (the host does not wait for them): say whose they are
            step = record.get("step")
            behind = f"step {step}: " if step is not None and step != self.bar.n else ""
            self.bar.set_postfix_str(behind + _fmt(record), refresh=False)
        elif self.stream is not None:
            where = f"step {record['step']}/{self.total}" if "lr" in record else "evaluation"
            print(f"{where} | {_fmt(record)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
