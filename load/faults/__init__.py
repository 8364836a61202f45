"""Engine faults under load: what clients see of a kill or a freeze, with resume off and on."""
