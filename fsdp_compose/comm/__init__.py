"""The wire and the devices: every collective, the meshes a unit resolves, reused buffers,
side streams, the process-wide pieces and the differences between torch versions."""
