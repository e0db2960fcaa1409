"""Reliability and security tests: faults injected into real processes, figures printed."""
