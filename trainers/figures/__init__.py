"""What a step costs, from its compiled program: matmul FLOPs, memory per device, TFLOP/s and MFU."""
