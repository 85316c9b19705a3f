"""bench.report's training question: how does a training step with our
collectives compare with the same step under a framework's own? From
bench.keras_fit's runs: examples/keras_digits.py's model, data and optimizer,
trained with collectives.keras (Keras fit, and a custom loop) and with
TensorFlow's MultiWorkerMirroredStrategy (the same custom loop: Keras 3's fit
cannot run under it), in the same processes, epochs alternating."""

from bench.report_host import MWMS_NAME, library_version
from bench.report_runs import Measurement, Part, and_join, cell, markdown, provenance, short_machines, span

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
    return lines + provenance(shown)


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


TRAINING_PARTS = (Part("", keras_fit, write_keras_fit, "No current run trains against a framework's own "
                       "collectives.", readme_keras_fit),)
