"""What the experiments measure, each module named for it: step timings (timing), each op's time
in a step (op_times), how far runs drift from one device (divergence), a step's compute,
all-reduce and fixed costs (step_costs), the cost model fitted to them (cost_model, cost_report,
hardware with its profiles), the PyTorch peer (torch_peer) and figures (plots)."""
