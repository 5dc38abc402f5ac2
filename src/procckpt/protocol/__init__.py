"""The protocol between the two processes: environment variables, the control channel
(requests and acks in ``DIR/control/``) and the events journal. The only code both sides share."""
