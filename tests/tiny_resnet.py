"""A one-block, narrow ResNet: ResNet-18's code (BatchNorm synchronised over devices) at a
fraction of its compile time, for the checks that need BatchNorm, not ResNet-18's size."""

from functools import partial

from jax_dp.models import resnet

OPTIONS, check, per_device_state = resnet.OPTIONS, resnet.check, resnet.per_device_state
make = partial(resnet.make, stage_channels=(8, 16), blocks_per_stage=1)
