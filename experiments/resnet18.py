"""ResNet-18 on Fashion-MNIST with BatchNorm synced over devices (D2L, "concise multi-GPU").

Run: `python -m experiments.resnet18` trains the book's pair (1 device with batch 256 and
lr 0.1, then 2 devices with batch 512 and lr 0.2; 4 epochs). A full epoch takes tens of
minutes on a 2-core CPU: try `--train-examples 10000 --epochs 2` first.
"""

from experiments import cli, process, runs


def parser():
    """This experiment's flags and defaults."""
    return cli.training_parser(__spec__.name, __doc__, "resnet18", devices="1,2",
                               batch_size="256,512", lr="0.1,0.2", epochs=4)


if __name__ == "__main__":
    process.run(runs.train_runs, parser)
