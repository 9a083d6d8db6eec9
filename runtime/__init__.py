"""Runtime: executes a compiled pipeline (StageRunner, transports, driver); never imports passes."""
