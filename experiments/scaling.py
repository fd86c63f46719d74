"""When does data parallelism pay? Measure compute, all-reduce and fixed costs here, fit a cost
model, check its predictions against real steps, and draw it for the machines in a hardware file.

Run: `python -m experiments.scaling --model lenet` measures, each in a fresh process:
(a) the step's compute against the per-device batch on one device (many steps per compiled call,
no collective), with 1 core and with all of them; (b) psum, ring and star all-reduces from 4 KB to
the model's gradient size over 2 and 4 simulated devices in one process and over 2 processes
(jax.distributed, gloo on loopback); (c) a step's fixed cost (a call that does no work). It fits
an alpha-beta link per transport, predicts the step time of 1 process x 1, 2, 4 devices and 2
processes x 1 device (each on its own core), times those steps, and draws speedup curves of
LeNet and ResNet-18 up to 64 devices for the profiles of --profiles.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from experiments import cli, outputs, process

HERE = Path(__file__).parent
DEFAULTS = {"lenet": {"batch_size": 256, "steps": 20}, "resnet18": {"batch_size": 64, "steps": 2}}


def main(args) -> None:
    """Measure, fit, check the predictions, then draw the profiles' curves."""
    from experiments.measure import hardware, cost_model, cost_report, step_costs
    from jax_dp import devices, models

    profiles = hardware.load_profiles(args.profiles)
    outputs.check_writable(args.json)
    outputs.check_writable(args.plot, plot=True)
    d = DEFAULTS[args.model]
    batch = args.batch_size or d["batch_size"]
    steps, repeats = args.steps or d["steps"], args.repeats
    for k in args.devices:
        devices.check_count(k)
    if args.processes == 1 or args.processes < 0:
        raise ValueError(f"--processes must be 0 (skip) or at least 2, got {args.processes}")
    cpus = sorted(os.sched_getaffinity(0))
    if args.processes > len(cpus):
        raise ValueError(f"--processes {args.processes} needs a core each; this machine gives "
                         f"{len(cpus)}: pass {len(cpus)} or fewer (0 to skip)")
    if any(batch % k for k in args.devices + [args.processes or 1, 2 * args.processes or 1]):
        raise ValueError(f"--batch-size {batch} must split evenly over every --devices and "
                         "--processes count")
    grad = models.param_bytes(args.model)
    sizes = step_costs.message_sizes(grad, args.sizes)
    measured = step_costs.measure(args.model, batch, steps, repeats, sizes, args.devices,
                                    args.processes, cpus)
    result = cost_model.analyse(args.model, batch, grad, measured, len(cpus), profiles,
                                   step_costs.shapes(cost_model.BOOK))
    result.update(command="python -m " + " ".join([__spec__.name] + sys.argv[1:]), steps=steps,
                  repeats=repeats, cpu=step_costs.cpu_name(), cores=len(cpus))
    print(cost_report.markdown(result))
    outputs.write_json(args.json, result)
    if args.plot:
        cost_report.plot(result, args.plot)


def parser():
    """This experiment's flags."""
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--model", default="lenet", choices=sorted(DEFAULTS))
    p.add_argument("--devices", type=cli.comma_list(int, "counts"), default="1,2,4",
                   help="simulated device counts in one process to measure and predict")
    p.add_argument("--processes", type=int, default=2,
                   help="also measure this many processes x 1 device, each on its own core "
                        "(0: skip)")
    p.add_argument("--batch-size", type=cli.at_least(2),
                   help="global batch size (default: lenet 256, resnet18 64)")
    p.add_argument("--steps", type=cli.at_least(1),
                   help="steps per timed run (default: lenet 20, resnet18 2)")
    p.add_argument("--repeats", type=cli.at_least(1), default=3,
                   help="timed runs; figures are their medians")
    p.add_argument("--sizes", type=cli.at_least(2), default=6,
                   help="all-reduce message sizes, 4 KB to the gradients'")
    p.add_argument("--profiles", type=Path, default=HERE / "measure" / "hardware.json",
                   help="hardware profiles (JSON) to draw speedup curves for")
    p.add_argument("--json", type=Path, help="write every measurement and prediction here")
    p.add_argument("--plot", type=Path,
                   help="write a PNG of the checks and the profiles' curves here")
    return p


if __name__ == "__main__":
    process.run(main, parser)
