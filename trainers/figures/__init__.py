"""What a step costs, from its compiled program: FLOPs, memory per device, MFU."""
