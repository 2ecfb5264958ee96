"""`/dashboard`: a live page served by rampserve itself (plain HTML and JS, the chart library vendored in static/),
fed by one sampler task in the front end (`sampler`) whose arithmetic is pure (`series`)."""

from rampserve.serving.frontend.dashboard.routes import DashboardEndpoints as DashboardEndpoints
from rampserve.serving.frontend.dashboard.sampler import DashboardSampler as DashboardSampler
from rampserve.serving.frontend.dashboard.sampler import SamplerSettings as SamplerSettings
