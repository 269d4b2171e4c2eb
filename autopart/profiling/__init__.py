"""Measurements on this machine: ops alone, ops in place, stages in a pipeline (all kept in the
cost database), and a search's finalists run to choose among them."""
