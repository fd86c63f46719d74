"""LeNet on Fashion-MNIST from scratch, on 1 then k devices (D2L, "multiple GPUs from scratch").

Run: `python -m experiments.lenet` trains the book's pair (1 device, then 2; batch 256,
lr 0.2, 4 epochs), printing a line per epoch; both should reach test accuracy 0.75-0.78.
"""

from experiments import common


def main(args) -> None:
    """Train LeNet once per device count."""
    common.train_runs(args, "lenet", conv=args.conv)


if __name__ == "__main__":
    p = common.parser(__spec__.name, __doc__, devices="1,2", batch_size="256", lr="0.2", epochs=4)
    p.add_argument("--conv", default="auto", choices=["auto", "xla", "im2col"],
                   help="convolution: lax.conv ('xla', the readable one), or one matrix product "
                        "per layer ('im2col', twice as fast on XLA:CPU); auto: im2col on CPU")
    common.run(main, p)
