"""The HTTP routes, as classes bound to what they answer from: `V2Endpoints` (the Open Inference Protocol v2 with
Triton's binary-data extension, over the data plane), `ApplicationEndpoints` (Clipper's application interface and the
applications' admin), `RepositoryEndpoints` (Triton's model repository extension), `ObservabilityEndpoints`
(Prometheus metrics, JSON status); the dashboard's are `dashboard.DashboardEndpoints`. `routes.register_endpoints`
puts them all on an app, with the admin-token check (`admin.AdminToken`) on the admin routes; `messages` reads
request bodies and writes responses and errors."""
