"""Reliability and security tests (issue 7): faults injected into real processes, figures printed."""
