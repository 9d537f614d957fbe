"""Measuring and predicting: workloads, serving metrics, the side-by-side serving harness,
the capacity / traffic cost model, the roofline step-time model and plots."""
