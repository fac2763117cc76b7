"""The stack guide's commands and the two UIs, as a new user meets them, on the real stack.

- The commands of docs/stack.md's "Scheduler and deployments" block, read from the guide and run
  in order by bash on a fresh ``flowrl stack up`` of their own (the block starts and stops it).
- The Prefect UI and the MLflow UI in headless Chromium (``tests/browser.py``) on a stack
  started by ``flowrl stack up``: the deployments list, a 3-step run submitted from the
  rl-train deployment's Custom run form, that run's page (step lines in the log, the results
  table, the curve), the concurrency limits, the MLflow run's charts and the registered
  version's lineage. Every page fails the test if it says "Can't connect" (the Prefect UI's
  message when it cannot reach its API).

Without a Chromium (``apt-get install chromium``, which ``make setup-test`` does) the browser tests
skip, saying so. With ``FLOWRL_SCREENSHOTS=docs/screenshots`` they also write the
walkthrough's screenshots there (docs/ui.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from browser import launch, new_page, require_browser, schema_field, screenshot, wait_for

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JOB = "ui-demo"  # the job the Custom run form submits
STEPS = 3
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# Where the engines are: a developer's own settings must not steer the stack's clients.
ENGINE_VARIABLES = (
    "PREFECT_API_URL",
    "FLOWRL_PREFECT_API_URL",
    "MLFLOW_TRACKING_URI",
    "FLOWRL_MLFLOW_TRACKING_URI",
    "FLOWRL_STORAGE_URL",
    "FLOWRL_RAY_ADDRESS",
    "FLOWRL_SCHEDULER_FILE",
    "FLOWRL_POOL_GPUS",
    "FLOWRL_NAMESPACE",
)
TIMINGS: dict[str, float] = {}


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> dict:
    with _opener().open(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> list | dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with _opener().open(request, timeout=30) as r:
        return json.loads(r.read())


def _user_env(home: Path) -> dict[str, str]:
    """A user's shell: the venv's commands first on PATH, a home and config folder of the
    test's own (nothing in the checkout or the real ~/.config), no engine settings."""
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_VARIABLES}
    env |= {
        "FLOWRL_HOME": str(home / ".flowrl"),
        "FLOWRL_CONFIG_DIR": str(home / "config"),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def _stop_stack(env: dict[str, str]) -> None:
    """``flowrl stack down``; then SIGKILL, by PID, any component it left running."""
    state_file = Path(env["FLOWRL_HOME"]) / "stack" / "state.json"
    pids = []
    if state_file.exists():
        state = json.loads(state_file.read_text())
        pids = [c["pid"] for c in state["components"].values() if c["pid"]]
        pids += [state["supervisor"]["pid"]] if state.get("supervisor") else []
    subprocess.run(
        [sys.executable, "-m", "flowrl", "stack", "down"], env=env, cwd=REPO, timeout=180
    )
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # each component leads its own process group
        except (ProcessLookupError, PermissionError):
            pass


# ------------------------------------------------------------- the stack guide's commands


def readme_stack_commands(guide: Path = REPO / "docs" / "stack.md") -> list[str]:
    """The command lines of the ```bash block in docs/stack.md's "Scheduler and deployments"
    section (the README's docs map links it), as written (continuation lines joined, blank
    lines dropped)."""
    text = guide.read_text()
    section = text.split("## Scheduler and deployments", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    block = re.sub(r"\\\n\s*", "", block)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def _marked_script(lines: list[str]) -> str:
    """The lines as one bash script (variables carry over, as in a terminal) that prints its
    exit status and seconds after each line."""
    out = []
    for i, line in enumerate(lines):
        out.append(f"printf '\\n@@@ start {i}\\n'; __t=$(date +%s.%N)")
        out.append(line)
        out.append(f'printf \'\\n@@@ end {i} %s %s\\n\' "$?" "$(date +%s.%N)-$__t"')
    return "\n".join(out) + "\n"


def test_readme_stack_section_runs_as_written(tmp_path):
    lines = readme_stack_commands()
    assert any(re.match(r"flowrl stack up\b", line) for line in lines), lines
    assert any(re.search(r"\bflowrl jobs submit\b", line) for line in lines), lines
    env = _user_env(tmp_path)
    try:
        ran = subprocess.run(
            ["bash", "-c", _marked_script(lines)],
            cwd=REPO,  # the README's paths (configs/arithmetic.yaml) are the checkout's
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=1800,
        )
    finally:
        _stop_stack(env)  # whatever the block left running
    chunks = re.split(r"\n?@@@ start (\d+)\n", ran.stdout)[1:]
    results = {}
    for index, chunk in zip(chunks[::2], chunks[1::2], strict=True):
        output, _, end = chunk.partition("\n@@@ end ")
        if not end:  # bash was stopped inside this line
            continue
        rc, times = end.split()[1:3]
        finished, started = (float(t) for t in times.split("-"))
        results[int(index)] = (int(rc), output, finished - started)
    print()
    for i, line in enumerate(lines):
        rc, _, seconds = results.get(i, (None, "", 0.0))
        TIMINGS[f"README: {line.split('  #')[0].strip()}"] = seconds
        print(f"  {seconds:7.1f} s  rc={rc}  {line}")
    for i, line in enumerate(lines):
        assert i in results, f"never reached: {line!r}\n{ran.stdout[-3000:]}"
        rc, output, _ = results[i]
        assert rc == 0, f"{line!r} exited {rc}:\n{output[-3000:]}"
    waits = [results[i][1] for i, line in enumerate(lines) if " jobs wait " in line]
    assert waits and all("COMPLETED" in out for out in waits), waits


# ----------------------------------------------------------------------- the UIs, in Chromium


@dataclass
class UIStack:
    """A running stack and what a browser needs: its UI links (as ``stack up`` prints them)."""

    env: dict[str, str]
    prefect_ui: str
    mlflow_ui: str
    api_url: str
    mlflow_url: str
    pool_gpus: int


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for the module (``require_browser``: no browser installed skips,
    saying what to install, except in CI; one that is installed but does not start fails)."""
    require_browser()
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    try:
        chromium = launch(playwright)
    except BaseException:
        playwright.stop()
        raise
    yield chromium
    chromium.close()
    playwright.stop()


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory) -> UIStack:
    """``flowrl stack up`` as the README says, in a home of the module's own."""
    require_browser()  # no stack to start for tests that will skip
    env = _user_env(tmp_path_factory.mktemp("ui-stack"))
    try:
        up = subprocess.run(
            [sys.executable, "-m", "flowrl", "stack", "up"],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((Path(env["FLOWRL_HOME"]) / "stack" / "state.json").read_text())
        components = state["components"]
        ui = state.get("ui") or {  # links as `stack up` prints them (older stacks: derived)
            "prefect": components["prefect"]["url"].removesuffix("api"),
            "mlflow": components["mlflow"]["url"] + "/",
        }
        yield UIStack(
            env=env | state["env"],
            prefect_ui=ui["prefect"],
            mlflow_ui=ui["mlflow"],
            api_url=state["env"]["PREFECT_API_URL"],
            mlflow_url=components["mlflow"]["url"],
            pool_gpus=int(state["env"].get("FLOWRL_POOL_GPUS", "0")),
        )
    finally:
        _stop_stack(env)


@pytest.fixture
def page(browser):
    page = new_page(browser)
    yield page
    page.context.close()


def _open_prefect(page, stack: UIStack, nav: str) -> None:
    """The Prefect UI's root (the link ``stack up`` prints), then a link of its side bar."""
    page.goto(stack.prefect_ui)
    link = page.get_by_role("link", name=nav, exact=True)
    wait_for(page, link)
    link.click()


def _deployment_link(page, name: str):
    return page.locator("a[href*='/deployments/deployment/']", has_text=re.compile(f"^{name}$"))


def _flow_run(stack: UIStack, run_id: str) -> dict:
    return _get(f"{stack.api_url}/flow_runs/{run_id}")


def _deployment_runs(stack: UIStack, deployment: str) -> set[str]:
    """The ids of the stack's flow runs of ``deployment``."""
    body = {"deployments": {"name": {"any_": [deployment]}}}
    return {run["id"] for run in _post(f"{stack.api_url}/flow_runs/filter", body)}


def test_deployments_list_shows_every_deployment(browser, ui_stack, page):
    declared = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["deployments"]
    names = [d["name"] for d in declared]
    assert len(names) == 9, names
    _open_prefect(page, ui_stack, "Deployments")
    for name in names:
        wait_for(page, _deployment_link(page, name))
    screenshot(page, "prefect-deployments")


@dataclass
class UIRun:
    id: str
    state: str
    message: str
    seconds: float  # from the form's Submit to COMPLETED, as a user waits


@pytest.fixture(scope="module")
def ui_run(browser, ui_stack) -> UIRun:
    """A 3-step rl-train run submitted from the deployment's Custom run form, as a user
    would: Deployments → rl-train → Run → Custom run, job name, steps, prompts per step."""
    page = new_page(browser)
    try:
        _open_prefect(page, ui_stack, "Deployments")
        wait_for(page, _deployment_link(page, "rl-train"))
        _deployment_link(page, "rl-train").click()
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Custom run").click()
        steps = page.get_by_label("Steps (Optional)", exact=True)
        wait_for(page, steps)
        # The job's name, not the environment's: the one nested least deeply (on PostgreSQL,
        # Prefect keeps the form's schema as JSONB, whose objects come back in key-length
        # order, so `env` and its name come before the job's own).
        names = page.get_by_label("Name (Optional)", exact=True)
        names.first.wait_for()
        depth = "e => { let d = 0; for (; e; e = e.parentElement) d++; return d; }"
        depths = [names.nth(i).evaluate(depth) for i in range(names.count())]
        names.nth(depths.index(min(depths))).fill(JOB)
        schema_field(page, "Rollout", "Prompts Per Step").fill("16")
        steps.fill(str(STEPS))
        screenshot(page, "prefect-custom-run", page.get_by_text("Schedule (Optional)", exact=True))
        earlier = _deployment_runs(ui_stack, "rl-train")
        page.get_by_role("button", name="Submit", exact=True).click()
        submitted = time.monotonic()
        # The UI goes to the deployment's runs, the new one listed.
        run_link = page.locator("a[href*='/runs/flow-run/']")
        try:
            wait_for(page, run_link, timeout=60_000)
        except AssertionError:
            # Under the suite's load the stack's SQLite-backed API can refuse the form's
            # request (an error toast; the form stays): a user submits again, once, and only
            # when the API holds no new run of the deployment (nothing runs twice).
            assert _deployment_runs(ui_stack, "rl-train") == earlier, "run created, not shown"
            page.get_by_role("button", name="Submit", exact=True).click()
            wait_for(page, run_link)
        run_id = run_link.first.get_attribute("href").rstrip("/").rsplit("/", 1)[-1]
    finally:
        page.context.close()
    deadline = submitted + 1200
    while (run := _flow_run(ui_stack, run_id))["state_type"] not in TERMINAL:
        assert time.monotonic() < deadline, f"run {run_id} still {run['state_type']} after 20 min"
        time.sleep(2)
    seconds = time.monotonic() - submitted
    TIMINGS["UI run: Submit -> terminal state"] = seconds
    TIMINGS["UI run: Prefect's run time"] = run["total_run_time"]
    print(
        f"\n{STEPS}-step run from the form: {run['state_type']} {seconds:.1f} s after Submit "
        f"(Prefect's run time {run['total_run_time']:.1f} s)"
    )
    return UIRun(run_id, run["state_type"], run["state"].get("message") or "", seconds)


def test_custom_run_form_submits_a_3_step_run_that_completes(ui_stack, ui_run):
    assert ui_run.state == "COMPLETED", ui_run.message
    run = _flow_run(ui_stack, ui_run.id)
    config = run["parameters"]["config"]
    assert config["name"] == JOB and config["schedule"]["steps"] == STEPS


def _completed(ui_run: UIRun) -> None:
    if ui_run.state != "COMPLETED":
        pytest.fail(f"the run from the form ended {ui_run.state}: {ui_run.message}")


def _open_artifact(page, key: str) -> None:
    """From the run's Artifacts tab: the artifact's card, then its latest version."""
    card = page.get_by_text(key, exact=True)
    wait_for(page, card)
    card.first.click()  # a redrawn artifact has a card per version; each leads to its key
    latest = page.locator("a[href*='/artifacts/artifact/']")  # versions, newest first
    wait_for(page, latest)
    latest.first.click()


def _step_logs_stored(ui_stack, ui_run: UIRun, timeout_s: float = 60.0) -> None:
    """Wait until the API holds the run's last step line: a flow run's logs reach the API in
    batches, the last after its state may already say COMPLETED, and the page of a finished
    run reads them once."""
    last = f"step {STEPS}/{STEPS}:"
    body = {"logs": {"flow_run_id": {"any_": [ui_run.id]}}, "limit": 200}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = _post(f"{ui_stack.api_url}/logs/filter", body)
        if any(log["message"].startswith(last) for log in logs):
            return
        time.sleep(1.0)
    pytest.fail(f"the API holds no {last!r} log line of run {ui_run.id} after {timeout_s:.0f} s")


def test_run_page_shows_step_lines_and_results_table(browser, ui_stack, ui_run, page):
    _completed(ui_run)
    _step_logs_stored(ui_stack, ui_run)
    page.set_viewport_size({"width": 1280, "height": 1600})  # every log line of the run in view
    page.goto(f"{ui_stack.prefect_ui.rstrip('/')}/v2/runs/flow-run/{ui_run.id}?tab=Logs")
    # Named after its job, as a CLI run is.
    wait_for(page, page.get_by_role("link", name="Runs", exact=True))
    wait_for(page, page.get_by_text(JOB, exact=True))
    # One log line per step: reward, loss, s/step.
    for step in range(1, STEPS + 1):
        line = page.get_by_text(re.compile(rf"^step {step}/{STEPS}: reward -?\d+\.\d+"))
        wait_for(page, line)
    screenshot(page, "prefect-run-logs", page.get_by_text(re.compile(r"^step 1/")), "center")
    # The results table: fixed columns, a reward in every step's row.
    page.get_by_role("tab", name="Artifacts").click()
    wait_for(page, page.get_by_text(f"{JOB}-results", exact=True))
    screenshot(page, "prefect-run-artifacts", page.get_by_role("tab", name="Artifacts"))
    _open_artifact(page, f"{JOB}-results")
    table = page.get_by_role("table").first
    wait_for(page, table.get_by_role("columnheader", name="reward/mean"))
    headers = [h.strip() for h in table.get_by_role("columnheader").all_inner_texts()]
    assert headers[:5] == ["step", "reward/mean", "accuracy", "loss", "seconds"], headers
    rows = [
        [c.strip() for c in row.get_by_role("cell").all_inner_texts()]
        for row in table.locator("tbody tr").all()
    ]
    assert [row[0] for row in rows] == [str(s) for s in range(1, STEPS + 1)], rows
    for row in rows:
        float(row[1])  # a reward in every step's row
    screenshot(page, "prefect-results-table")


def test_run_page_shows_the_reward_curve(browser, ui_stack, ui_run, page):
    _completed(ui_run)
    page.goto(f"{ui_stack.prefect_ui.rstrip('/')}/v2/runs/flow-run/{ui_run.id}?tab=Artifacts")
    _open_artifact(page, f"{JOB}-curve")
    image = page.locator("img[src^='data:image/svg+xml']")
    wait_for(page, image)
    assert image.first.evaluate("img => img.complete && img.naturalWidth > 0")
    screenshot(page, "prefect-curve")


def test_concurrency_page_shows_the_gpu_limit(browser, ui_stack, page):
    _open_prefect(page, ui_stack, "Concurrency")
    row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="gpu", exact=True))
    wait_for(page, row)
    cells = [c.strip() for c in row.first.get_by_role("cell").all_inner_texts()]
    assert cells[:2] == ["gpu", str(ui_stack.pool_gpus)], cells
    screenshot(page, "prefect-concurrency")


def _mlflow_run_link(stack: UIStack) -> str:
    """The MLflow link the run's ``<job>-mlflow`` artifact gives (the user's way in)."""
    (artifact,) = _post(
        f"{stack.api_url}/artifacts/filter",
        {"artifacts": {"key": {"any_": [f"{JOB}-mlflow"]}}},
    )
    match = re.search(r"\((https?://[^)\s]+)\)", artifact["data"])
    assert match, artifact["data"]
    return match.group(1)


def _close_mlflow_assistant(page) -> None:
    """The MLflow Assistant side panel opens on a first visit; a user closes it."""
    if page.get_by_role("button", name="New Chat", exact=True).count():  # the panel is open
        page.get_by_role("button", name="Close", exact=True).first.click()


def _open_mlflow_run(page, stack: UIStack) -> None:
    page.goto(_mlflow_run_link(stack))
    wait_for(page, page.get_by_text(JOB, exact=True))
    _close_mlflow_assistant(page)


def test_mlflow_run_shows_its_metric_charts(browser, ui_stack, ui_run, page):
    from playwright.sync_api import expect

    _completed(ui_run)
    _open_mlflow_run(page, ui_stack)
    # A model-training run (Runs), not a GenAI evaluation (Evaluations).
    wait_for(page, page.get_by_role("link", name="Runs", exact=True))
    assert page.get_by_text("Evaluations", exact=True).count() == 0
    page.get_by_role("tab", name="Model metrics").click()
    search = page.get_by_placeholder(re.compile("Search metric charts"))
    wait_for(page, search)
    search.fill("reward/")  # the reward section: mean, accuracy, ...
    wait_for(page, page.get_by_text(f"{JOB} (reward/mean)", exact=True))
    # Each chart drawn (a plot, no longer a spinner).
    charts = page.get_by_text(re.compile(rf"^{JOB} \(reward/")).count()
    wait_for(page, page.locator(".js-plotly-plot"))
    expect(page.locator(".js-plotly-plot")).to_have_count(charts)
    screenshot(page, "mlflow-run-charts")


def test_mlflow_model_version_shows_its_lineage(browser, ui_stack, ui_run, page):
    _completed(ui_run)
    _open_mlflow_run(page, ui_stack)
    # The run's overview lists its registered version: the way to the version's page.
    version = page.locator(f"a[href*='#/models/{JOB}/versions/']")
    wait_for(page, version)
    version.first.click()
    wait_for(page, page.get_by_text(re.compile(r"^Version \d+$")))
    _close_mlflow_assistant(page)
    wait_for(page, page.get_by_text(re.compile(rf"rl-train job {JOB}")))  # the description
    for tag in ("flowrl.job", "flowrl.kind", "flowrl.base_model", "flowrl.environment"):
        wait_for(page, page.get_by_text(tag, exact=True))
    screenshot(page, "mlflow-model-version", page.get_by_text("flowrl.base_model"), "center")


def teardown_module() -> None:
    if TIMINGS:
        print("\ntimings:")
        for what, seconds in TIMINGS.items():
            print(f"  {seconds:7.1f} s  {what}")
