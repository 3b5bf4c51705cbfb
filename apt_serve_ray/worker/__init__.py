"""What runs a step on this machine: the model runner, calibration, CPU facts and affinity."""
