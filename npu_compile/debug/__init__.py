"""Instruments: the dump dir, report.json, tlparse artifacts, verification, and (later) plots and traces."""
