"""The exact mode: the same float32 bits on 1, 2, 4 or 8 devices.

A sum of floats depends on its order, and `lax.psum`'s order is unspecified. Here every sum
over examples is taken in one order that does not depend on the device count: the global batch
is cut into MICRO_BATCHES micro-batches of m examples (padding rows at fixed global positions),
each micro-batch is computed alone (every product on exactly m examples, so XLA picks the same
kernels for any k), and the per-micro-batch results are added in one balanced binary tree in
global micro-batch order: its lower levels on each device, its upper levels across devices by
recursive doubling (micro.py). One device computes the same tree.

A model without batch statistics is run whole on each micro-batch. BatchNorm ties a batch's
examples together, so a model with it runs each layer on the micro-batches instead (layers.py
swaps its Flax module's layer types), its statistics summed in the same tree (batch_norm.py).
steps.make_steps builds the steps; assembly.build chooses it over jax_dp.step.make_steps.
"""
