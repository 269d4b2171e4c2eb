"""Measurements that fill the cost database: ops alone, ops in place, stages in a pipeline."""
