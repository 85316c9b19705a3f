"""bench.report's training question: how does a training step with our
collectives compare with the same step under a framework's own? From
bench.keras_fit's runs: examples/keras_digits.py's model, data and optimizer,
trained with collectives.keras (Keras fit, and a custom loop) and with
TensorFlow's MultiWorkerMirroredStrategy (the same custom loop: Keras 3's fit
cannot run under it), in the same processes, epochs alternating; and from
bench.ddp_step's runs: examples/ddp.py under torchrun, DDP on our process
group against Gloo's, with and without our compression hook."""

from bench.report_host import MWMS_NAME, library_version
from bench.report_runs import Measurement, Part, and_join, cell, markdown, short_machines, span

KERAS_FIT = "bench.keras_fit"
KINDS = {"ours_fit": "ours, Keras fit", "ours_loop": "ours, custom loop", "mwms_loop": "MWMS, custom loop"}


def keras_fit(run):
    data = run.data
    if run.tool != KERAS_FIT or not all(isinstance(data.get(kind), dict) for kind in KINDS):
        return []
    ranks = data.get("ranks")
    configuration = (KERAS_FIT, ranks, data.get("global_batch"), data.get("epochs"))
    label = f"{ranks} processes, global batch {data.get('global_batch')}, {data.get('epochs')} epochs"
    return [Measurement(run, configuration, label, data)]


def write_keras_fit(shown, runs):
    lines = ["Step time: the median over every step after the first epoch (which traces), on rank 0; MWMS / ours "
             "is the custom loop's over ours in the same loop. Test accuracy on the 600 test digits after the last "
             "epoch, the same NumPy forward pass for each.", ""]
    header = ["run", "what", "step (ms)", "MWMS / ours", "test accuracy", "ranks bitwise equal"]
    body = []
    for m in shown:
        for kind, name in KINDS.items():
            got = m.content[kind]
            ratio = ratio_of(m.content) if kind == "mwms_loop" else None
            body.append([m.label, name, cell(got["step_ms_median"]), cell(ratio),
                         f"{100 * got['test_accuracy']:.2f}%", str(got["ranks_bitwise_identical"])])
    lines += [*markdown(header, body, text_columns=2), ""]
    for m in shown:
        apart = m.content.get("max_weight_difference", {})
        lines += [f"{m.label}: largest difference between the weights the trainings ended with: ours' loop "
                  f"and MWMS' {cell(apart.get('ours_loop_vs_mwms_loop'))}, ours' fit and loop "
                  f"{cell(apart.get('ours_fit_vs_ours_loop'))}.", ""]
    return lines


def ratio_of(content):
    """MWMS' custom loop step over ours'."""
    return content["mwms_loop"]["step_ms_median"] / content["ours_loop"]["step_ms_median"]


def readme_keras_fit(shown, runs):
    """One row for every configuration shown: the range of the ratios, the process counts, the accuracies."""
    if not shown:
        return []

    def accuracies(kind):
        return and_join(sorted({f"{100 * m.content[kind]['test_accuracy']:.2f}%" for m in shown}))

    processes = and_join([str(n) for n in sorted({m.content["ranks"] for m in shown})])
    return [[library_version(MWMS_NAME, [m.machine_environment for m in shown]),
             f"a Keras training step, custom loop (`bench.keras_fit`), {processes} processes; test accuracy "
             f"{accuracies('ours_loop')} ours, {accuracies('mwms_loop')} theirs",
             span([ratio_of(m.content) for m in shown]), short_machines(shown)]]


DDP_STEP = "bench.ddp_step"


def ddp_step(run):
    data = run.data
    if run.tool != DDP_STEP or not isinstance(data.get("runs"), list):
        return []
    hosts = data.get("hosts")
    where = (f"{hosts['count']} hosts of {data['processes'] // hosts['count']} processes, {hosts['link']} links"
             if hosts else f"{data.get('processes')} processes on one machine")
    configuration = (DDP_STEP, data.get("processes"), where, data.get("hidden"), data.get("epochs"))
    return [Measurement(run, configuration, f"{where}, hidden {data.get('hidden')}", data)]


def ddp_ratio(content, run="collectives"):
    """Gloo's step over `run`'s (above 1: `run` is faster), None if either is missing."""
    steps = {r["run"]: r["step_ms_median"] for r in content["runs"]}
    return steps["gloo"] / steps[run] if "gloo" in steps and run in steps else None


def write_ddp_step(shown, runs):
    lines = ["Step time: rank 0's median over the rounds of examples/ddp.py's own clock per step (zero_grad, "
             "forward, backward, step); Gloo / run is Gloo's step over the run's (above 1: the run is faster). "
             "A run named BACKEND+CODEC sends DDP's buckets through collectives.torch.compression_hook.", ""]
    header = ["configuration", "run", "step (ms)", "Gloo / run", "test accuracy", "ranks bitwise equal"]
    body = [[m.label, r["run"], cell(r["step_ms_median"]), cell(ddp_ratio(m.content, r["run"])),
             and_join(sorted({f"{100 * a:.2f}%" for a in r["test_accuracy"]})), str(r["ranks_bitwise_identical"])]
            for m in shown for r in m.content["runs"]]
    return [*lines, *markdown(header, body, text_columns=2)]


def readme_ddp_step(shown, runs):
    rows = []
    for m in shown:
        ratios = [ddp_ratio(m.content, r["run"]) for r in m.content["runs"] if r["run"] != "gloo"]
        named = [r["run"] for r in m.content["runs"] if r["run"] != "gloo"]
        if not any(ratios):
            continue
        rows.append([library_version("Gloo", [m.machine_environment]),
                     f"a DDP training step (`bench.ddp_step`), {m.label}: {', '.join(named)}",
                     span([r for r in ratios if r]), short_machines([m])])
    return rows


TRAINING_PARTS = (Part("Keras against MultiWorkerMirroredStrategy", keras_fit, write_keras_fit, "No current run trains against a framework's own "
                       "collectives.", readme_keras_fit),
                  Part("DDP against Gloo", ddp_step, write_ddp_step, "No current run times DDP's step.",
                       readme_ddp_step))
