"""Any model on Fashion-MNIST, on 1 then k devices: a registered name or a module of your own.

Run: `python -m experiments.train --model lenet --devices 1,2` trains like experiments.lenet;
`--model my_package.my_model` trains a model module of your own (docs/models.md), with a
flag for each of its options (`--model NAME --help` lists them).
"""

from experiments import cli, process, runs


def parser():
    """This experiment's flags: the common ones, and those of the model --model names."""
    return cli.training_parser(__spec__.name, __doc__, cli.chosen_model("lenet"),
                               devices="1", batch_size="256", lr="0.1", epochs=4,
                               choose_model=True)


if __name__ == "__main__":
    process.run(runs.train_runs, parser)
