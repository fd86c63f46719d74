"""LeNet on Fashion-MNIST from scratch, on 1 then k devices (D2L, "multiple GPUs from scratch").

Run: `python -m experiments.lenet` trains the book's pair (1 device, then 2; batch 256,
lr 0.2, 4 epochs), printing a line per epoch; both should reach test accuracy 0.75-0.78.
"""

from experiments import cli, process, runs


def parser():
    """This experiment's flags and defaults."""
    return cli.training_parser(__spec__.name, __doc__, "lenet", devices="1,2",
                               batch_size="256", lr="0.2", epochs=4)


if __name__ == "__main__":
    process.run(runs.train_runs, parser)
