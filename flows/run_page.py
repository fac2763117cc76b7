"""What a run shows in the Prefect UI: its name (the job's, ``job_run_name``), plain-English
log lines (a phase's start and end, a line per step or per k steps), a progress artifact, and
its artifacts: ``<job>-results``, a table of the job's fixed ``Column`` s by step;
``<job>-curve``, a picture of the plotted columns redrawn as the job runs; ``<job>-summary``
and ``<job>-mlflow``, a link to the MLflow run. ``JobRun`` owns one ``RunPage`` and feeds it
what the job logs."""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel
from tqdm import tqdm

from flowrl.infra.plot import Series, curve_svg
from flowrl.infra.redact import redact_text

STEP_LINES = 50
"""A job logs a step line every ``max(1, steps // STEP_LINES)`` steps (and at each step with an
evaluation, and the last)."""
CURVE_UPDATES = 10
"""The curve artifact is redrawn every ``max(1, steps // CURVE_UPDATES)`` steps and at each
evaluation (an SVG, ``infra.plot``: ~1 ms a drawing; done by a thread of the page's own, off
the step's path)."""
TABLE_ROWS = 500
"""A longer job's results table keeps every k-th step so that about this many rows remain,
and every evaluated step and the last."""


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of a job's results table (``<job>-results``), a field of its step lines and,
    with ``plot``, a curve of its ``<job>-curve`` picture."""

    name: str
    """The table's header, e.g. ``reward/mean``."""
    metrics: tuple[str, ...]
    """The metrics (as logged with ``JobRun.log``) that fill it; at a step, the last logged."""
    text: str
    """The step line's words for a value, a format string: ``"reward {:.3f}"``."""
    evaluated: bool = False
    """Filled only at the steps with an evaluation (an empty cell elsewhere)."""
    plot: bool = False
    """Drawn on the job's curve."""


def job_run_name(schema: type[BaseModel]) -> Callable[[], str]:
    """A flow's ``flow_run_name``: the name of the job its ``config`` parameter (of type
    ``schema``) names. Prefect calls it as a run starts and renames the run, so a run started
    from the UI's form (``config`` a dict) is named as ``flowrl jobs submit`` names it; a
    config that does not validate leaves the flow's name (the flow then fails on it)."""

    def name() -> str:
        config = flow_run.get_parameters().get("config")
        if isinstance(config, dict):
            try:
                config = schema.model_validate(config)
            except ValueError:
                config = None
        job = getattr(config, "name", None)
        return str(job) if job else (flow_run.get_flow_name() or "flowrl-job")

    return name


@dataclasses.dataclass
class Phase:
    """A phase of a job being logged (``RunPage.phase``): set ``result`` to what it ended with."""

    result: str = "done"


class RunPage:
    """One job's run as the Prefect UI shows it. It keeps the values of the job's ``columns``
    by step (``record``) and from them writes the step lines, the curve and the results table;
    with no columns it logs no step lines and draws no curve. Artifact keys start with ``key``
    (the namespace and job name, made a valid key)."""

    def __init__(self, job: str, key: str, columns: tuple[Column, ...] = ()):
        self.job = job
        self.columns = columns
        self.key = _artifact_key(key)
        self.cells: dict[int, dict[str, float]] = {}
        """step -> column name -> value."""
        self._column_of = {m: c.name for c in columns for m in c.metrics}
        self._progress: tuple[Any, int] | None = None
        self._bar: tqdm | None = None
        # Curves are drawn and sent by one thread, in order, while the job's next stage runs.
        self._drawing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-page-curve")
        self._drawn: list[Future] = []

    @property
    def metrics(self) -> list[str]:
        """The metrics that fill the columns."""
        return list(self._column_of)

    def record(self, metrics: dict[str, float], step: int) -> None:
        """Keep the values of the job's columns among ``metrics`` logged at ``step``."""
        for key, value in metrics.items():
            column = self._column_of.get(key)
            if column is not None:
                self.cells.setdefault(step, {})[column] = float(value)

    # --------------------------------------------------------------------------- log

    def say(self, line: str) -> None:
        """One line of the run's log (the Prefect flow run's logger), URL user-info redacted."""
        get_run_logger().info(redact_text(line))

    @contextlib.contextmanager
    def phase(self, name: str, start: str = "started") -> Iterator[Phase]:
        """Log a phase of the job: ``<name>: <start>`` as it begins, ``<name>: <result> (12.3
        s)`` as it ends (``Phase.result``, set by the caller), ``<name>: failed after …`` if
        it raises."""
        self.say(f"{name}: {start}")
        phase, began = Phase(), time.perf_counter()
        try:
            yield phase
        except BaseException:
            self.say(f"{name}: failed after {time.perf_counter() - began:.1f} s")
            raise
        self.say(f"{name}: {phase.result} ({time.perf_counter() - began:.1f} s)")

    def step_line(self, step: int, total: int) -> str:
        """``step 3/20: reward 0.412, loss 0.113, 1.80 s/step, accuracy 0.550``: the step's
        values of the job's columns, evaluations last."""
        row = self.cells.get(step, {})
        ordered = [c for c in self.columns if not c.evaluated] + self._evaluated()
        words = [c.text.format(row[c.name]) for c in ordered if c.name in row]
        return f"step {step}/{total}" + (f": {', '.join(words)}" if words else "")

    # ---------------------------------------------------------------------- progress

    def start_steps(self, start: int, total: int) -> None:
        """The steps from ``start`` to ``total`` begin: a progress bar and a Prefect progress
        artifact."""
        artifact = create_progress_artifact(
            progress=100.0 * start / total, description=f"steps of {self.job}"
        )
        self._progress = (artifact, total)
        self._bar = tqdm(total=total, initial=start, desc=self.job, unit="step")

    def advance(self, before: int, done_steps: int, postfix: dict[str, float]) -> None:
        """From ``before`` to ``done_steps`` steps done: the progress bar, the progress artifact
        every 10 steps and at the end (each update is an API round trip), the step's log line
        (``STEP_LINES``) and the curve (``CURVE_UPDATES``) when due."""
        if self._bar is not None:
            self._bar.update(done_steps - before)
            self._bar.set_postfix({k: f"{v:.2f}" for k, v in postfix.items()})
        if self._progress is None:
            return
        artifact, total = self._progress
        if done_steps % 10 == 0 or done_steps >= total or done_steps - before >= 10:
            update_progress_artifact(artifact, progress=100.0 * done_steps / total)
        if not self.columns:
            return
        evaluated = any(c.name in self.cells.get(done_steps, {}) for c in self._evaluated())
        last = done_steps >= total
        if evaluated or last or _crossed(before, done_steps, max(1, total // STEP_LINES)):
            self.say(self.step_line(done_steps, total))
        if evaluated or _crossed(before, done_steps, max(1, total // CURVE_UPDATES)):
            self.draw_curve(f"step {done_steps} of {total}")

    def close(self) -> None:
        """Close the progress bar; wait for a curve still being drawn (a failed drawing is
        logged, not raised: the job's outcome is decided already)."""
        if self._bar is not None:
            self._bar.close()
        try:
            self.wait_for_curve()
        except Exception as e:  # noqa: BLE001 - see above
            get_run_logger().warning("the curve artifact could not be drawn: %s", e)
        finally:
            self._drawing.shutdown(wait=True)

    # ------------------------------------------------------------------------ curve

    def curves(self) -> Series:
        """The plotted columns' values by step."""
        plotted = [c.name for c in self.columns if c.plot]
        series: Series = {name: [] for name in plotted}
        for step in sorted(self.cells):
            for name in plotted:
                if name in self.cells[step]:
                    series[name].append((step, self.cells[step][name]))
        return series

    def draw_curve(self, caption: str, wait: bool = False) -> None:
        """The ``<job>-curve`` markdown artifact: the job's plotted columns against step as an
        embedded PNG (a new version of the artifact each time; the UI shows the latest). Drawn
        and sent by the page's thread, in the run's context; ``wait``: until it is sent (and
        raise what failed)."""
        series = self.curves()
        if any(series.values()):
            context = contextvars.copy_context()  # the flow run the artifact belongs to
            self._drawn.append(self._drawing.submit(context.run, self._send_curve, series, caption))
        if wait:
            self.wait_for_curve()

    def wait_for_curve(self) -> None:
        """Wait until the curves drawn so far are sent; raise the first one's error."""
        drawn, self._drawn = self._drawn, []
        for future in drawn:
            future.result()

    def _send_curve(self, series: Series, caption: str) -> None:
        svg = base64.b64encode(curve_svg(series).encode()).decode("ascii")
        markdown = f"# {self.job}\n\n![curve](data:image/svg+xml;base64,{svg})\n\n{caption}"
        create_markdown_artifact(
            markdown, key=f"{self.key}-curve", description=f"{', '.join(series)} by step"
        )

    # ----------------------------------------------------------------------- tables

    def results_table(self) -> list[dict[str, float | None]]:
        """The results table: a row per step with a value of a column that is not an
        evaluation's, every column in every row (``None`` where no evaluation ran), values to
        4 decimals; a long job's thinned (``TABLE_ROWS``)."""
        names = [c.name for c in self.columns]
        trained = {c.name for c in self.columns if not c.evaluated}
        steps = [s for s in sorted(self.cells) if trained & set(self.cells[s])]
        every = max(1, -(-len(steps) // TABLE_ROWS))  # ceil: thin a long job's rows
        evaluated = {c.name for c in self._evaluated()}
        kept = [
            s
            for i, s in enumerate(steps)
            if i % every == 0 or s == steps[-1] or evaluated & set(self.cells[s])
        ]
        rows = []
        for s in kept:
            cells = self.cells[s]
            rows.append({"step": s} | {n: _rounded(cells.get(n)) for n in names})
        return rows

    def publish(
        self, record: dict[str, Any], rows: list[dict[str, Any]], run_id: str, link: str
    ) -> None:
        """The finished run's artifacts: ``<job>-mlflow``, a link to MLflow run ``run_id`` at
        ``link``; ``<job>-results``, ``rows`` as a table (if any); ``<job>-summary``, a
        markdown table of the result ``record`` and the last row."""
        key = self.key
        create_link_artifact(
            link, link_text=f"MLflow run {run_id}", key=f"{key}-mlflow", description="MLflow"
        )
        if rows:
            create_table_artifact(rows, key=f"{key}-results", description="metrics by step")
        lines = [f"# {self.job}", "", f"MLflow run: [{run_id}]({link})", ""]
        lines += ["| result | value |", "|---|---|"]
        lines += [f"| {k} | {_cell(v)} |" for k, v in record.items()]
        if rows:
            last = ", ".join(f"{k} {_cell(v)}" for k, v in rows[-1].items() if v is not None)
            lines += ["", f"Last logged step: {last}"]
        create_markdown_artifact("\n".join(lines), key=f"{key}-summary", description="summary")

    def _evaluated(self) -> list[Column]:
        return [c for c in self.columns if c.evaluated]


def _artifact_key(name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "job"


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in (``before``, ``after``]."""
    return after // every > before // every


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _cell(value: Any) -> str:
    text = f"{value:.4f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")[:200]
