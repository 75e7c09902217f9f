"""What a step costs: the per-sequence work record (`SeqWork`), the roofline cost model, and the
hardware and engine profiles it reads. Torch-free, below the engine: the SLO policy predicts
step times with it, and the simulator prices its steps with it."""
