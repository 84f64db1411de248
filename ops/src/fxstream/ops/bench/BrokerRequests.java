// The broker's own request and record counters, read over JMX for `./fx bench profile`.
//
// Run as a single source file (`java BrokerRequests.java <broker pid>`, JDK 11+). It
// attaches to the broker's JVM through the attach API (only the user running the broker
// may: no JMX port is opened, nothing listens on the network), starts the JVM's local
// management agent there, and then, for each line read on stdin, prints one line of JSON:
//   {"requests": {"<API>": count, ...}, "records_in": {"<topic>": count, ...},
//    "bytes_in": {"<topic>": bytes, ...}, "bytes_out": {"<topic>": bytes, ...}}
// with Kafka's cumulative counters (RequestMetrics RequestsPerSec by request, summed over
// versions; BrokerTopicMetrics MessagesInPerSec, BytesInPerSec and BytesOutPerSec by
// topic: bytes written by producers and read by consumers). The caller takes differences.
// It exits at the end of stdin.

import com.sun.tools.attach.VirtualMachine;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.Map;
import java.util.TreeMap;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnector;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;

public final class BrokerRequests {
    private BrokerRequests() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: java BrokerRequests.java <broker pid>");
            System.exit(2);
        }
        VirtualMachine vm = VirtualMachine.attach(args[0]);
        String address;
        try {
            address = vm.startLocalManagementAgent();
        } finally {
            vm.detach();
        }
        try (JMXConnector connector = JMXConnectorFactory.connect(new JMXServiceURL(address))) {
            MBeanServerConnection server = connector.getMBeanServerConnection();
            BufferedReader in =
                    new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
            while (in.readLine() != null) {
                Map<String, Long> requests = counts(server,
                        "kafka.network:type=RequestMetrics,name=RequestsPerSec,*", "request");
                Map<String, Long> records = counts(server,
                        "kafka.server:type=BrokerTopicMetrics,name=MessagesInPerSec,topic=*",
                        "topic");
                Map<String, Long> bytesIn = counts(server,
                        "kafka.server:type=BrokerTopicMetrics,name=BytesInPerSec,topic=*",
                        "topic");
                Map<String, Long> bytesOut = counts(server,
                        "kafka.server:type=BrokerTopicMetrics,name=BytesOutPerSec,topic=*",
                        "topic");
                System.out.println("{\"requests\": " + json(requests)
                        + ", \"records_in\": " + json(records)
                        + ", \"bytes_in\": " + json(bytesIn)
                        + ", \"bytes_out\": " + json(bytesOut) + "}");
                System.out.flush();
            }
        }
    }

    private static Map<String, Long> counts(MBeanServerConnection server, String pattern,
            String property) throws Exception {
        Map<String, Long> found = new TreeMap<>();
        for (ObjectName name : server.queryNames(new ObjectName(pattern), null)) {
            String label = name.getKeyProperty(property);
            if (label == null) {
                continue;
            }
            Object count = server.getAttribute(name, "Count");
            if (count instanceof Number number) {
                found.merge(label, number.longValue(), Long::sum);
            }
        }
        return found;
    }

    private static String json(Map<String, Long> counts) {
        StringBuilder out = new StringBuilder("{");
        for (Map.Entry<String, Long> entry : counts.entrySet()) {
            if (out.length() > 1) {
                out.append(", ");
            }
            // API and topic names are [A-Za-z0-9._-]: nothing to escape.
            out.append('"').append(entry.getKey()).append("\": ").append(entry.getValue());
        }
        return out.append('}').toString();
    }
}
