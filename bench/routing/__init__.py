"""`swaserve bench routing` (`main.py`): the policies on a simulated cluster (`sim.py`, `workloads.py`,
`figures.py`), the model presets (`stacks.py`), the real stack (`real.py`, `real_traffic.py`);
`runs.py` runs them and `report.py` / `stacks_report.py` write what they found."""
