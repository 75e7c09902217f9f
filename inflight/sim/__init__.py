"""The simulator: the production scheduler and block manager driven by a cost model instead of a
model, on a virtual clock; its calibration on the machine at hand; and a configuration tuner."""
