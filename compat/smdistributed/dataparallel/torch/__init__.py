"""SageMaker-compatible import path, provided by smddp."""
