package idemprom_test

import (
	"log"
	"net/http"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemprom"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func ExampleNewCollector() {
	e, err := idem.Open("/var/lib/orders/idem", nil)
	if err != nil {
		log.Fatal(err)
	}
	c, err := idemprom.NewCollector(e, &idemprom.Options{ConstLabels: prometheus.Labels{"engine": "orders"}})
	if err != nil {
		log.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
}
