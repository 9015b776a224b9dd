"""The wire and the devices: every collective, the meshes a unit resolves, reused buffers,
side streams, the observer slot and the differences between torch versions."""
