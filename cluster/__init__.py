"""The Ray control plane, the one package that imports Ray: controller, pools, replica actors, autoscaler, Serve app."""
