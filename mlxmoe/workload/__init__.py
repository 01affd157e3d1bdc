"""What a workload is: activation profiles, routing traces (record, import, replay), the
predicted hit-rate curves, and their charts."""
