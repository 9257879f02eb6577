"""The worker side: the actor and what runs in its process. It never imports the driver's packages."""
