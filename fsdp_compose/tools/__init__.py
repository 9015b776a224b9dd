"""Around the runtime: StepTrace and its report, the planner, and gradient clipping over meshes."""
